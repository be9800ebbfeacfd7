"""Reference lookups kept in memory (store.report_lookups): reused while nothing may have changed
them, forgotten the moment something may have: this process's own writes of tags and reports, and
another process's, heard as events (PostgreSQL NOTIFY, a shared SQLite file's notices).

The pure rules run on a fake clock; the rest on real stores, SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from scanner.models import GpuFacts, ImageReport, LibcVerdict, PlatformReport
from store import AsyncStore, SqliteStore, queries
from store.queries.tags import TagSeen
from store.report_lookups import LOCAL_REUSE_SECONDS, Found, ReportLookups
from tests.conftest import OpenBackend

REGISTRY, REPOSITORY = "127.0.0.1:5000", "team/app"
OLD, NEW = "sha256:" + "a" * 64, "sha256:" + "c" * 64


def report(digest: str, tag: str = "1") -> ImageReport:
    return ImageReport(
        reference=f"{REGISTRY}/{REPOSITORY}:{tag}",
        digest=digest,
        registry=REGISTRY,
        repository=REPOSITORY,
        tag=tag,
        platforms=[PlatformReport(platform="linux/amd64", digest=digest, gpu=GpuFacts(), libc=LibcVerdict())],
    )


def scanned(digest: str, tag: str = "1") -> list[TagSeen | ImageReport]:
    """What a scan of `REPOSITORY:tag` writes when it finds `digest`: the tag, then the report."""
    return [TagSeen(REGISTRY, REPOSITORY, tag, digest), report(digest, tag)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Reads:
    """A stand-in for the store read: answers `digest` for any reference, counted."""

    def __init__(self) -> None:
        self.digest: str | None = OLD
        self.count = 0
        self.gate: asyncio.Event | None = None  # when set: each read waits for it

    async def __call__(self, registry: str, repository: str, tag: str, digest: str | None) -> Found:
        self.count += 1
        if self.gate is not None:
            await self.gate.wait()
        return (self.digest, report(self.digest) if self.digest else None, None)


async def test_a_found_lookup_is_reused_until_forgotten_or_too_old() -> None:
    reads, clock = Reads(), Clock()
    lookups = ReportLookups(reads, reuse_seconds=30, cross_process=lambda: True, clock=clock)
    assert (await lookups.reference_report(REGISTRY, REPOSITORY, "1", None))[0] == OLD
    clock.now += 29
    assert (await lookups.reference_report(REGISTRY, REPOSITORY, "1", None))[0] == OLD
    assert reads.count == 1
    reads.digest = NEW
    lookups.forget()
    assert (await lookups.reference_report(REGISTRY, REPOSITORY, "1", None))[0] == NEW
    assert reads.count == 2
    clock.now += 30  # the safety net: events may have been lost
    await lookups.reference_report(REGISTRY, REPOSITORY, "1", None)
    assert reads.count == 3


async def test_without_other_processes_events_a_lookup_is_reused_for_one_second_at_most() -> None:
    reads, clock = Reads(), Clock()
    lookups = ReportLookups(reads, reuse_seconds=30, cross_process=lambda: False, clock=clock)
    await lookups.reference_report(REGISTRY, REPOSITORY, "1", None)
    clock.now += LOCAL_REUSE_SECONDS * 0.9
    await lookups.reference_report(REGISTRY, REPOSITORY, "1", None)
    assert reads.count == 1
    clock.now += LOCAL_REUSE_SECONDS * 0.2
    await lookups.reference_report(REGISTRY, REPOSITORY, "1", None)
    assert reads.count == 2


async def test_a_lookup_in_flight_while_something_changed_is_answered_but_not_kept() -> None:
    reads = Reads()
    reads.gate = asyncio.Event()
    lookups = ReportLookups(reads, cross_process=lambda: True)
    in_flight = asyncio.create_task(lookups.reference_report(REGISTRY, REPOSITORY, "1", None))
    while reads.count == 0:
        await asyncio.sleep(0)
    lookups.forget()  # a write committed while the read was on its way
    reads.gate.set()
    assert (await in_flight)[0] == OLD
    reads.gate = None
    await lookups.reference_report(REGISTRY, REPOSITORY, "1", None)
    assert reads.count == 2  # read again: the raced answer was not kept


async def test_unknown_references_are_never_kept_and_the_kept_ones_are_bounded() -> None:
    reads = Reads()
    reads.digest = None
    lookups = ReportLookups(reads, entries=2, cross_process=lambda: True)
    for _ in range(2):
        assert (await lookups.reference_report(REGISTRY, REPOSITORY, "1", None))[0] is None
    assert reads.count == 2
    reads.digest = OLD
    for tag in ("1", "2", "3", "1"):  # "1" went first (least recently used) when "3" came
        await lookups.reference_report(REGISTRY, REPOSITORY, tag, None)
    assert reads.count == 2 + 4
    await lookups.reference_report(REGISTRY, REPOSITORY, "3", None)
    assert reads.count == 6


async def test_this_process_writes_of_tags_and_reports_are_seen_at_once(open_backend: OpenBackend) -> None:
    store = AsyncStore(open_backend(), report_cache_seconds=3600)
    try:
        await store.run(queries.save_scan_results, scanned(OLD))
        assert (await store.reference_report(REGISTRY, REPOSITORY, "1", None))[0] == OLD
        assert (await store.reference_report(REGISTRY, REPOSITORY, "1", None))[0] == OLD
        assert store.report_lookups.reads == 1
        await store.run(queries.save_scan_results, scanned(NEW, tag="2"))  # another tag: forgets anyway
        assert (await store.reference_report(REGISTRY, REPOSITORY, "1", None))[0] == OLD
        await store.run(queries.record_tag, REGISTRY, REPOSITORY, "1", NEW)  # the tag moved
        digest, found, _ = await store.reference_report(REGISTRY, REPOSITORY, "1", None)
        assert digest == NEW and found is not None and found.digest == NEW
        await store.run(queries.mark_gone, REGISTRY, REPOSITORY, tag="1", digest=None)
        assert await store.reference_report(REGISTRY, REPOSITORY, "1", None) == (None, None, None)
    finally:
        await store.close()


@pytest.fixture(params=["sqlite-shared", "postgres"])
def two_processes(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[AsyncStore, AsyncStore]]:
    """Two stores on one database that hear each other's commits, as two processes would."""
    if request.param == "postgres":
        from store.postgres import PostgresStore

        url = request.getfixturevalue("postgres_url")
        backends = [PostgresStore(url, pool_size=2), PostgresStore(url, pool_size=2)]
    else:
        backends = [SqliteStore(tmp_path / "s.db", shared_events=True) for _ in range(2)]
    yield (
        AsyncStore(backends[0], report_cache_seconds=3600),
        AsyncStore(backends[1], report_cache_seconds=3600),
    )


@pytest.mark.parametrize("change", ["report", "tag moved", "tag deleted", "manifest deleted"])
async def test_another_process_change_reaches_the_kept_lookups_as_an_event(
    two_processes: tuple[AsyncStore, AsyncStore], change: str
) -> None:
    api, worker = two_processes
    try:
        for store in (api, worker):
            await store.start_events()
            assert store.events.cross_process
        settles: list[None] = []
        heard = asyncio.Event()

        def on_settled() -> None:
            settles.append(None)
            heard.set()

        async def heard_settles(count: int) -> None:
            while True:
                heard.clear()
                if len(settles) >= count:
                    return
                await asyncio.wait_for(heard.wait(), 10)

        api.events.on_settled(on_settled)
        await worker.run(queries.save_scan_results, scanned(OLD))
        await worker.run(queries.save_scan_results, scanned(NEW, tag="2"))
        await heard_settles(2)  # one notice per save: its reference's
        assert (await api.reference_report(REGISTRY, REPOSITORY, "1", None))[0] == OLD
        reads = api.report_lookups.reads
        assert (await api.reference_report(REGISTRY, REPOSITORY, "1", None))[0] == OLD
        assert api.report_lookups.reads == reads  # kept

        expected: str | None = OLD
        if change == "report":
            await worker.run(queries.save_report, report(OLD))  # scanned again
        elif change == "tag moved":
            await worker.run(queries.record_tag, REGISTRY, REPOSITORY, "1", NEW)
            expected = NEW
        elif change == "tag deleted":
            await worker.run(queries.mark_gone, REGISTRY, REPOSITORY, tag="1", digest=None)
            expected = None
        else:
            await worker.run(queries.mark_gone, REGISTRY, REPOSITORY, tag=None, digest=OLD)
            expected = None
        await heard_settles(3)
        assert (await api.reference_report(REGISTRY, REPOSITORY, "1", None))[0] == expected
        assert api.report_lookups.reads == reads + 1
        assert len(settles) == 3  # nothing else was told
    finally:
        await api.close()
        await worker.close()
