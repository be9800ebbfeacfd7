"""The scanner's `ScanCache` for one command that scans many references (`gpubadge scan`).

The service's scans each wait for their own commit (`StoreScanCache`): a job is finished only
after its report is stored, and the long polls wake on that commit. A command scanning a
list has a different shape: it knows every reference up front and prints as it goes. Here

- what each tag pointed at is read once for the whole list (`preload`, one statement per
  repository), instead of one read per scan;
- so is the set of digests the store holds, where it holds few enough (`stored_digests`, at
  most `DIGESTS_PER_REFERENCE` per listed reference): a scan whose digest is not among them
  needs no lookup at all. A first scan of a list into a new or small store makes no reads;
- writes are queued and committed in batches (up to `max_batch` writes, or what gathered in
  `linger` seconds): one transaction, one thread hop and one prepared statement per kind for
  the batch, instead of one of each per report;
- the digest lookups of concurrent scans (`stored`) wait up to `read_linger` (5 ms, well under
  one registry round trip) and go to the store in one read: a thread hop costs more CPU than
  the lookup itself, and a list's scans ask in bursts;
- a report is reported to the user only after its commit (`when_committed`), so what was
  printed is stored: the durability is the service's, the commits are fewer.

Reads of a digest queued but not yet committed are answered from the queue, so a digest seen
twice in one list is scanned once. A report another process stores after the preload is not
seen by this command's lookups: its digest is scanned again and stored again, as it would be
had the other process stored it a moment after a lookup.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Sequence

from scanner.models import ImageReport, PlatformReport
from scanner.registry.reference import ReferenceError, parse_reference
from store import queries
from store.events import REPORTED_JOB, SETTLED
from store.facade import AsyncStore
from store.queries.tags import TagSeen

TagKey = tuple[str, str, str]
# Up to this many stored digests per listed reference are read up front (`preload`): reading a
# digest costs about a microsecond, a lookup's thread hop a hundred times that; past the bound
# (a store far larger than the list) each scan asks for its own digest instead.
DIGESTS_PER_REFERENCE = 20
DIGESTS_PRELOAD_FLOOR = 10_000
DIGESTS_PRELOAD_MAX = 200_000
Committed = Callable[[BaseException | None], None]
Stored = tuple[ImageReport | None, PlatformReport | None]


class BatchScanCache:
    """Batched store access for `scan_many` over a known list (see the module's docstring).

    `close()` commits what is still queued and returns the first commit failure, if any;
    every `when_committed` callback has been called by then, each with its batch's error.
    """

    def __init__(
        self, store: AsyncStore, *, max_batch: int = 256, linger: float = 0.05, read_linger: float = 0.005
    ) -> None:
        self._store = store
        self._max_batch = max_batch
        self._linger = linger
        self._read_linger = read_linger
        self._tags: dict[TagKey, str | None] = {}
        self._queued: list[TagSeen | ImageReport] = []
        self._queued_reports: dict[str, ImageReport] = {}  # by digest, until committed
        self._queued_platforms: dict[str, PlatformReport] = {}
        self._sequence = itertools.count(1)
        self._last_queued = 0  # the sequence number of the newest queued write
        self._callbacks: list[tuple[int, Committed]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._flushing: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None
        self._lookups: dict[str, list[asyncio.Future[Stored]]] = {}
        # every digest the store held at `preload` (images, platforms); None: ask for each
        self._known: tuple[frozenset[str], frozenset[str]] | None = None
        self._looking_up: asyncio.Task[None] | None = None

    @property
    def store(self) -> AsyncStore:
        return self._store

    async def preload(self, references: Sequence[str]) -> None:
        """Read what each tag among `references` points at now, in one hop for them all;
        `resolve_tag` then answers them without a read. References that do not parse, or
        that name a digest, are left to their scans. Then the stored digests, if the store
        holds few enough for the list's length: `stored` answers a digest not among them at
        once."""
        limit = min(DIGESTS_PRELOAD_MAX, max(DIGESTS_PRELOAD_FLOOR, DIGESTS_PER_REFERENCE * len(references)))
        self._known = await self._store.run(queries.stored_digests, limit)
        wanted: list[TagKey] = []
        for text in references:
            with contextlib.suppress(ReferenceError):  # the scan's report says why
                reference = parse_reference(text)
                key = (reference.registry, reference.repository, reference.tag or "")
                if reference.tag and reference.digest is None and key not in self._tags:
                    wanted.append(key)
        if wanted:
            self._tags.update(await self._store.run(queries.resolve_tags, wanted))

    # ------------------------------------------------------------------ reads

    async def report(self, digest: str) -> ImageReport | None:
        queued = self._queued_reports.get(digest)
        return queued if queued is not None else await self._store.run(queries.report, digest)

    async def platform_report(self, digest: str) -> PlatformReport | None:
        queued = self._queued_platforms.get(digest)
        return queued if queued is not None else await self._store.run(queries.platform_report, digest)

    async def stored(self, digest: str) -> Stored:
        """The digest's stored report (`queries.stored`). Lookups wait up to `read_linger` and go to the
        store together (`queries.stored_many`): one hop for the scans that asked meanwhile,
        instead of one each. What is queued here answers before the store."""
        image, platform = self._queued_reports.get(digest), self._queued_platforms.get(digest)
        if image is not None or platform is not None:
            return image, platform
        if self._known is not None and digest not in self._known[0] and digest not in self._known[1]:
            return None, None  # not stored when the list began, nor queued since
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Stored] = loop.create_future()
        self._lookups.setdefault(digest, []).append(answer)
        if self._looking_up is None:
            self._looking_up = loop.create_task(self._look_up())
        return await answer

    async def _look_up(self) -> None:
        """Answer what was asked, batch after batch, until nothing waits."""
        try:
            await asyncio.sleep(self._read_linger)
            while self._lookups:
                batch, self._lookups = self._lookups, {}
                try:
                    found = await self._store.run(queries.stored_many, list(batch))
                except Exception as exc:  # each scan that asked gets the store's own error
                    for answers in batch.values():
                        for answer in answers:
                            if not answer.done():
                                answer.set_exception(exc)
                    continue
                for digest, answers in batch.items():
                    for answer in answers:
                        if not answer.done():
                            answer.set_result(found[digest])
        finally:
            self._looking_up = None

    async def resolve_tag(self, registry: str, repository: str, tag: str) -> str | None:
        key = (registry, repository, tag)
        if key in self._tags:
            return self._tags[key]
        return await self._store.run(queries.resolve_tag, registry, repository, tag)

    async def layer_evidence(self, digest: str) -> str | None:
        return await self._store.run(queries.layer_evidence, digest)

    async def layer_evidences(self, digests: Sequence[str]) -> dict[str, str]:
        return await self._store.run(queries.layer_evidences, digests)

    async def scan_in_flight(self, job_id: str) -> bool:
        return await self._store.run(queries.scan_in_flight, job_id)

    async def save_layer_evidence(self, digest: str, evidence_json: str) -> None:
        await self._store.run(queries.save_layer_evidence, digest, evidence_json)

    # ----------------------------------------------------------------- writes

    async def record_tag(self, registry: str, repository: str, tag: str, digest: str) -> None:
        self._queue(TagSeen(registry, repository, tag, digest))

    async def save_report(self, report: ImageReport, *, with_next_write: bool = False) -> None:
        """Queue the report (and its tag) for the next batch; `when_committed` says when it is stored
        (every write here waits for its batch, so `with_next_write` changes nothing)."""
        if report.error is not None or report.digest is None:
            raise ValueError("only successful reports are stored")  # before it can fail a batch
        if report.registry and report.repository and report.tag:
            self._queue(TagSeen(report.registry, report.repository, report.tag, report.digest))
        self._queue(report)

    def when_committed(self, callback: Committed) -> None:
        """Call `callback` once every write queued so far is committed (at once if none is
        waiting), with the error of the batch that failed, if one did."""
        if not self._queued and self._flushing is None and not self._callbacks:
            callback(None)
        else:
            self._callbacks.append((self._last_queued, callback))

    async def close(self) -> BaseException | None:
        """Commit everything still queued; the first commit failure of this cache's life, if any."""
        while self._queued or self._flushing is not None:
            if self._flushing is None:
                self._flush_now()
            assert self._flushing is not None
            await asyncio.shield(self._flushing)
        return self._failure

    def _queue(self, write: TagSeen | ImageReport) -> None:
        self._last_queued = next(self._sequence)
        self._queued.append(write)
        if isinstance(write, TagSeen):
            self._tags[(write.registry, write.repository, write.tag)] = write.digest
        else:
            assert write.digest is not None
            self._queued_reports[write.digest] = write
            for platform in write.platforms:
                self._queued_platforms[platform.digest] = platform
        if self._flushing is None:  # else the running batch schedules the next one when it ends
            self._schedule()

    def _schedule(self) -> None:
        if len(self._queued) >= self._max_batch:
            self._flush_now()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._linger, self._flush_now)

    def _flush_now(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._flushing is None and self._queued:
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        """Commit what is queued, in one transaction; then call the callbacks it covers. What
        gathers meanwhile waits for its own linger (or a full batch): one commit per `linger`."""
        batch, self._queued = self._queued, []
        covered = self._last_queued
        error: BaseException | None = None
        try:
            await self._store.run(queries.save_scan_results, batch)
        except Exception as exc:
            error = exc
            self._failure = self._failure or exc
        finally:
            self._flushing = None
            if self._queued:
                self._schedule()
        for write in batch:
            if isinstance(write, ImageReport) and write.digest is not None:
                if self._queued_reports.get(write.digest) is write:
                    del self._queued_reports[write.digest]
                    for platform in write.platforms:
                        if self._queued_platforms.get(platform.digest) is platform:
                            del self._queued_platforms[platform.digest]
                if error is None:
                    self._store._fire_local(SETTLED, f"{REPORTED_JOB} {write.reference}")
        self._call_back(covered, error)

    def _call_back(self, covered: int, error: BaseException | None) -> None:
        due = [callback for sequence, callback in self._callbacks if sequence <= covered]
        self._callbacks = [
            (sequence, callback) for sequence, callback in self._callbacks if sequence > covered
        ]
        for callback in due:
            callback(error)
