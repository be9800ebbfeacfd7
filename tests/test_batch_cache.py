"""`gpubadge scan`'s store access (store/batch_cache.py): tags read once for the list, writes
committed in batches, and a report handed back only once its commit is done.

Each test runs on SQLite and on PostgreSQL (`open_backend`).
"""

from __future__ import annotations

import asyncio
import collections
import threading
from typing import Any

import pytest

from scanner.models import ImageReport
from store import AsyncStore, StoreUnavailable, queries
from store.batch_cache import BatchScanCache
from tests.conftest import OpenBackend
from tests.test_store import _report

REGISTRY = "127.0.0.1:5000"


def _tagged(n: int) -> ImageReport:
    digest = "sha256:" + f"{n:064x}"
    return _report(digest).model_copy(update={"tag": f"v{n}", "reference": f"{REGISTRY}/app:v{n}"})


def test_resolve_tags_answers_every_key_with_its_newest_state(open_backend: OpenBackend) -> None:
    store = open_backend()
    one, two = "sha256:" + "1" * 64, "sha256:" + "2" * 64
    store.run(queries.record_tag, REGISTRY, "app", "moved", one)
    store.run(queries.record_tag, REGISTRY, "app", "moved", two)  # a new history row: the newest counts
    store.run(queries.record_tag, REGISTRY, "app", "kept", one)
    store.run(queries.record_tag, REGISTRY, "other", "kept", two)
    store.run(queries.mark_gone, REGISTRY, "other", tag="kept", digest=None)
    keys = [
        (REGISTRY, "app", "moved"),
        (REGISTRY, "app", "kept"),
        (REGISTRY, "app", "never"),
        (REGISTRY, "other", "kept"),
        ("elsewhere.example", "app", "kept"),
    ]
    found = store.run(queries.resolve_tags, keys)
    assert found == {key: store.run(queries.resolve_tag, *key) for key in keys}
    assert found[(REGISTRY, "app", "moved")] == two and found[(REGISTRY, "app", "never")] is None


class _CountingBackend:
    """The backend with its queries counted, and save_scan_results failing while `failing` is set."""

    def __init__(self, backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.backend = backend
        self.run_query = backend.run
        monkeypatch.setattr(backend, "run", self.run)
        self.calls: collections.Counter[str] = collections.Counter()
        self.batches: list[int] = []
        self.failing = threading.Event()

    def run(self, query: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls[query.name] += 1
        if query is queries.save_scan_results:
            if self.failing.is_set():
                raise StoreUnavailable("the disk is full")
            self.batches.append(len(args[0]))
        return self.run_query(query, *args, **kwargs)


async def test_a_list_is_written_in_few_commits_and_each_report_handed_back_once_committed(
    open_backend: OpenBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    counting = _CountingBackend(open_backend(), monkeypatch)
    backend = counting.backend
    backend.run(queries.record_tag, REGISTRY, "app", "v7", "sha256:" + "7" * 64)  # seen before
    store = AsyncStore(backend)
    reader = open_backend()  # another process's view: only what was committed
    cache = BatchScanCache(store, max_batch=16, linger=0.01)
    reports = [_tagged(n) for n in range(1, 41)]
    committed: list[str] = []

    def handed_back(report: ImageReport, error: BaseException | None) -> None:
        assert error is None
        assert reader.run(queries.report, report.digest) is not None  # durable before it is shown
        committed.append(report.reference)

    try:
        await cache.preload(
            [r.reference for r in reports] + ["not a reference!", f"{REGISTRY}/app@sha256:{'0' * 64}"]
        )
        assert counting.calls["resolve_tags"] == 1
        assert await cache.resolve_tag(REGISTRY, "app", "v7") == "sha256:" + "7" * 64
        assert await cache.resolve_tag(REGISTRY, "app", "v8") is None
        assert counting.calls["resolve_tag"] == 0  # answered from the preload

        async def scan(report: ImageReport) -> None:
            await asyncio.sleep(0)
            await cache.save_report(report)
            cache.when_committed(lambda error: handed_back(report, error))

        await asyncio.gather(*(scan(report) for report in reports))
        # queued, not yet committed: reads are answered from the queue, not the store
        assert reports[-1].digest is not None
        image, _ = await cache.stored(reports[-1].digest)
        assert image is reports[-1]
        assert await cache.resolve_tag(REGISTRY, "app", "v40") == reports[-1].digest
        assert await cache.close() is None
        assert sorted(committed) == sorted(r.reference for r in reports)
        assert sum(counting.batches) == 80  # every tag and every report, once
        assert len(counting.batches) <= 6  # in a few shared transactions, not one per scan
        assert reader.run(queries.resolve_tag, REGISTRY, "app", "v40") == reports[-1].digest
        assert counting.calls["stored"] == 0
    finally:
        await store.close()
        reader.close()


async def test_a_failed_batch_is_handed_back_with_its_error_and_the_next_batch_still_commits(
    open_backend: OpenBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    counting = _CountingBackend(open_backend(), monkeypatch)
    backend = counting.backend
    store = AsyncStore(backend)
    cache = BatchScanCache(store, linger=0.01)
    outcomes: dict[str, BaseException | None] = {}
    order: list[str] = []
    first_back = asyncio.Event()

    def handed_back(name: str) -> Any:
        def callback(error: BaseException | None) -> None:
            outcomes[name] = error
            order.append(name)
            if name == "first":
                first_back.set()

        return callback

    try:
        cache.when_committed(handed_back("before anything"))  # nothing queued: at once
        assert outcomes == {"before anything": None}
        counting.failing.set()
        await cache.save_report(_tagged(1))
        cache.when_committed(handed_back("first"))
        failed_scan = ImageReport(reference=f"{REGISTRY}/app:broken", error="manifest unknown")
        cache.when_committed(handed_back(failed_scan.reference))  # waits its turn, in order
        await asyncio.wait_for(first_back.wait(), 10)  # after the linger, the batch's commit fails
        counting.failing.clear()
        await cache.save_report(_tagged(2))
        cache.when_committed(handed_back("second"))
        failure = await cache.close()
        assert isinstance(failure, StoreUnavailable)
        assert isinstance(outcomes["first"], StoreUnavailable) and outcomes["second"] is None
        assert order == ["before anything", "first", failed_scan.reference, "second"]
        assert backend.run(queries.report, _tagged(2).digest) is not None
        assert backend.run(queries.report, _tagged(1).digest) is None
        with pytest.raises(ValueError, match="only successful reports"):
            await cache.save_report(failed_scan)
    finally:
        await store.close()


@pytest.mark.parametrize("preloaded", [False, True], ids=["asked", "preloaded"])
async def test_concurrent_digest_lookups_share_one_read_and_answer_as_stored_does(
    open_backend: OpenBackend, monkeypatch: pytest.MonkeyPatch, preloaded: bool
) -> None:
    counting = _CountingBackend(open_backend(), monkeypatch)
    backend = counting.backend
    saved = _tagged(1)
    backend.run(queries.save_report, saved)
    platform_digest = saved.platforms[0].digest
    unknown = ["sha256:" + f"{n:064x}" for n in range(100, 120)]
    store = AsyncStore(backend)
    cache = BatchScanCache(store)
    try:
        if preloaded:  # the digests the store holds, read up front: the unknown ones need no read
            await cache.preload([f"{REGISTRY}/app:v{n}" for n in range(100, 120)])
            assert counting.calls["stored_digests"] == 1
            assert await asyncio.gather(*(cache.stored(digest) for digest in unknown)) == [(None, None)] * 20
            assert counting.calls["stored_many"] == 0
        asked = [saved.digest, platform_digest, *unknown]
        answers = await asyncio.gather(*(cache.stored(digest) for digest in asked if digest))
        assert counting.calls["stored_many"] == 1 and counting.calls["stored"] == 0
        assert answers == [backend.run(queries.stored, digest) for digest in asked]
        assert answers[0][0] is not None and answers[1][1] is not None and answers[2] == (None, None)
    finally:
        await store.close()


async def test_a_store_larger_than_the_preload_bound_is_asked_per_digest(
    open_backend: OpenBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    counting = _CountingBackend(open_backend(), monkeypatch)
    backend = counting.backend
    for n in (1, 2, 3):
        backend.run(queries.save_report, _tagged(n))
    assert backend.run(queries.stored_digests, 3) is not None
    assert backend.run(queries.stored_digests, 2) is None  # three stored, more than asked for
    monkeypatch.setattr("store.batch_cache.DIGESTS_PRELOAD_FLOOR", 2)
    monkeypatch.setattr("store.batch_cache.DIGESTS_PER_REFERENCE", 1)
    store = AsyncStore(backend)
    cache = BatchScanCache(store)
    try:
        await cache.preload([f"{REGISTRY}/app:v9"])
        unknown = "sha256:" + "9" * 64
        assert await cache.stored(unknown) == (None, None)
        assert counting.calls["stored_many"] == 1  # no digest set to answer from: read
        image, _ = await cache.stored(_tagged(2).digest)
        assert image is not None and image.digest == _tagged(2).digest
    finally:
        await store.close()


def test_recording_tags_in_one_batch_leaves_the_history_that_one_call_each_leaves(
    open_backend: OpenBackend,
) -> None:
    from store.queries import TagSeen

    store = open_backend()
    a, b, c = ("sha256:" + ch * 64 for ch in "abc")
    for repository in ("one-by-one", "batched"):  # the same starting state in both
        store.run(queries.record_tag, REGISTRY, repository, "stays", a)
        store.run(queries.record_tag, REGISTRY, repository, "moves", a)
        store.run(queries.record_tag, REGISTRY, repository, "deleted", b)
        store.run(queries.mark_gone, REGISTRY, repository, tag="deleted", digest=None)
        store.run(queries.mark_gone, REGISTRY, repository, tag=None, digest=c)
    seen = [
        ("stays", a),  # unchanged: last_seen only
        ("moves", b),  # moved: a new row
        ("moves", a),  # and back in the same batch: another row
        ("new", c),  # first seen; its digest is no longer gone
        ("new", c),  # seen twice: still one row
        ("deleted", b),  # pushed again after its deletion: a new row
    ]
    for tag, digest in seen:
        store.run(queries.record_tag, REGISTRY, "one-by-one", tag, digest)
    store.run(queries.record_tags, [TagSeen(REGISTRY, "batched", tag, digest) for tag, digest in seen])

    def history(repository: str) -> list[tuple[str, str, bool]]:
        events = store.run(queries.tag_history, REGISTRY, repository)
        return [(event.tag, event.digest, event.gone_at is not None) for event in events]

    assert history("batched") == history("one-by-one")
    assert [tag for tag, _, _ in history("batched")].count("moves") == 3
    assert not store.run(queries.is_gone, REGISTRY, "batched", c)
    assert store.run(queries.resolve_tag, REGISTRY, "batched", "deleted") == b
