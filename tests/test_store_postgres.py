"""PostgreSQL only: what must hold between processes that share one database.

Each `PostgresStore` here has its own connection pool, as each API or worker
replica does; threads start together behind a barrier so the statements really
race. (The behaviour both engines share is in tests/test_store.py, run on both.)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import psycopg
import pytest

from jobs.intake import JobIntake
from store import AsyncStore, EnqueueBatch, queries
from store.dialect import Db, reads, writes
from store.events import ALL_CHANNELS, JOB_CHANNELS, REFERENCE_CHANNEL
from store.migrations import latest_version, migrations
from store.models import GpuTaken, StoreUnavailable
from store.postgres import JOB_SETTLED, JOBS_QUEUED, LISTENER_NAME, Notification, PostgresStore
from store.postgres_intake import INTAKE_NAME, LoopIntake

T = TypeVar("T")
REPLICAS = 4


@pytest.fixture
def replicas(postgres_url: str) -> Iterator[list[PostgresStore]]:
    stores = [PostgresStore(postgres_url, pool_size=8) for _ in range(REPLICAS)]
    try:
        yield stores
    finally:
        for store in stores:
            store.close()


def race(calls: list[Callable[[], T]]) -> list[T | BaseException]:
    """Run every call at once (a barrier releases them together); results or exceptions, in order."""
    barrier = threading.Barrier(len(calls), timeout=30)

    def run(call: Callable[[], T]) -> T | BaseException:
        barrier.wait()
        try:
            return call()
        except Exception as exc:
            return exc

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


def test_migrations_apply_once_when_replicas_start_together(postgres_url: str) -> None:
    stores = race([lambda: PostgresStore(postgres_url, pool_size=1) for _ in range(6)])
    try:
        assert all(isinstance(store, PostgresStore) for store in stores), stores
        first = stores[0]
        assert isinstance(first, PostgresStore)
        assert first.schema_version() == latest_version("postgres")
        with psycopg.connect(postgres_url) as conn:
            versions = [row[0] for row in conn.execute("SELECT version FROM schema_migrations ORDER BY 1")]
        assert versions == [migration.version for migration in migrations("postgres")]
    finally:
        for store in stores:
            if isinstance(store, PostgresStore):
                store.close()


def test_the_same_push_on_every_replica_makes_one_job(replicas: list[PostgresStore]) -> None:
    references = [(f"r.example/app{n}:v1", "r.example") for n in range(40)]
    # every replica enqueues every reference at the same instant, in a different order
    calls = [
        (lambda store=store, shift=shift: store.enqueue(references[shift:] + references[:shift]))
        for shift, store in zip((0, 10, 20, 30), replicas, strict=True)
    ]
    outcomes = race(calls)
    ids_by_reference: dict[str, set[str]] = collections.defaultdict(set)
    for shift, ids in zip((0, 10, 20, 30), outcomes, strict=True):
        assert isinstance(ids, list), ids
        rotated = references[shift:] + references[:shift]
        for (reference, _), job_id in zip(rotated, ids, strict=True):
            ids_by_reference[reference].add(job_id)
    assert all(len(ids) == 1 for ids in ids_by_reference.values()), ids_by_reference
    assert replicas[0].run(queries.queue_depth)["queued"] == len(references)


def test_concurrent_claims_take_each_job_once_and_keep_the_registry_cap(
    replicas: list[PostgresStore],
) -> None:
    store = replicas[0]
    store.enqueue([(f"busy.example/app{n}:1", "busy.example") for n in range(30)])
    store.enqueue([(f"quiet.example/app{n}:1", "quiet.example") for n in range(30)])
    cap = 5
    claims = race(
        [
            (
                lambda replica=replica, n=n: replica.claim_jobs(
                    8, owner=f"w{n}", lease_seconds=60, per_registry=cap
                )
            )
            for n, replica in enumerate(replicas)
        ]
    )
    claimed = [job for jobs in claims if isinstance(jobs, list) for job in jobs]
    assert len(claims) == len([c for c in claims if isinstance(c, list)]), claims
    assert len({job.id for job in claimed}) == len(claimed)  # nobody took a job twice
    per_registry = collections.Counter(job.registry for job in claimed)
    assert per_registry == {"busy.example": cap, "quiet.example": cap}  # exact across 4 claimers
    assert all(job.state == "running" and job.lease_owner for job in claimed)
    # a second round finds the cap reached everywhere until a job settles
    assert store.claim_jobs(8, owner="late", lease_seconds=60, per_registry=cap) == []
    first = claimed[0]
    assert store.finish_job(first.id, digest="sha256:" + "0" * 64, owner=first.lease_owner or "")
    (next_job,) = store.claim_jobs(8, owner="late", lease_seconds=60, per_registry=cap)
    assert next_job.registry == first.registry


def test_two_replicas_never_reserve_one_gpu_twice(replicas: list[PostgresStore]) -> None:
    gpus = [f"GPU-{n:02d}" for n in range(8)]
    # 100 deploys over two replicas, each wanting two GPUs from an overlapping pool of 8
    wants = [sorted({gpus[n % 8], gpus[(n * 3 + 1) % 8]}) for n in range(100)]
    calls = [
        (lambda n=n, want=want: replicas[n % 2].create_deployment(f"d{n}", "node-a", want, "{}"))
        for n, want in enumerate(wants)
    ]
    outcomes = race(calls)
    assert all(outcome is None or isinstance(outcome, GpuTaken) for outcome in outcomes), outcomes
    won = [n for n, outcome in enumerate(outcomes) if outcome is None]
    taken = [gpu for n in won for gpu in wants[n]]
    assert len(taken) == len(set(taken)), "a GPU was reserved twice"
    reserved = replicas[1].run(queries.reserved_gpus)
    assert reserved == {gpu: f"d{n}" for n in won for gpu in wants[n]}
    # a losing deploy left nothing behind: no partial reservation, no deployment row
    assert {record for record in replicas[0].run(queries.deployments, limit=200)} and len(
        replicas[0].run(queries.deployments, limit=200)
    ) == len(won)


async def _heard(heard: asyncio.Queue[Notification], wanted: Notification) -> None:
    async with asyncio.timeout(10):
        while await heard.get() != wanted:
            pass


@contextlib.asynccontextmanager
async def _relaying(
    store: PostgresStore, channels: Sequence[str] = ALL_CHANNELS
) -> AsyncIterator[tuple[asyncio.Queue[Notification], asyncio.Event]]:
    """`store.relay_notifications` running on this loop, listening: what it hears, and its `listening`."""
    heard: asyncio.Queue[Notification] = asyncio.Queue()
    listening = asyncio.Event()
    relay = asyncio.create_task(store.relay_notifications(heard.put_nowait, listening, channels))
    try:
        async with asyncio.timeout(10):
            await listening.wait()
        yield heard, listening
    finally:
        relay.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await relay


async def test_notifications_cross_replicas_on_the_event_loop(replicas: list[PostgresStore]) -> None:
    api, worker = replicas[0], replicas[1]
    async with _relaying(api) as (heard, _):
        # a thread between the connection and the loop would cost a wake-up and a hand-over a notice
        assert not [thread for thread in threading.enumerate() if "listen" in thread.name]
        [job_id] = await asyncio.to_thread(worker.enqueue, [("r.example/app:1", "r.example")])
        await _heard(heard, (JOBS_QUEUED, ""))  # a job queued elsewhere wakes us
        [job] = await asyncio.to_thread(worker.claim_jobs, 1, owner="w", lease_seconds=60)
        assert await asyncio.to_thread(worker.finish_job, job.id, digest="sha256:" + "1" * 64, owner="w")
        await _heard(heard, (JOB_SETTLED, f"{job_id} r.example/app:1"))  # ?wait= here learns it at once


async def test_a_process_that_only_scans_hears_the_queue_and_no_stored_report(
    replicas: list[PostgresStore],
) -> None:
    """A worker process holds no long poll: a reference's change (a report stored, a tag moved) would
    only wake its loop, once per worker process, for each one written."""
    api, writer = replicas[0], replicas[1]
    async with _relaying(api) as (everything, _), _relaying(api, JOB_CHANNELS) as (queue_only, _):
        await asyncio.to_thread(writer.run, queries.mark_gone, "r.example", "app", tag="1", digest=None)
        await _heard(everything, (REFERENCE_CHANNEL, "r.example/app:1"))
        await asyncio.to_thread(writer.enqueue, [("r.example/app:2", "r.example")])
        async with asyncio.timeout(10):
            assert await queue_only.get() == (JOBS_QUEUED, "")  # the first it heard: no reference before it
        await _heard(everything, (JOBS_QUEUED, ""))
        assert queue_only.empty() and everything.empty()


async def test_a_listener_whose_connection_is_cut_reconnects_and_says_to_look_again(
    replicas: list[PostgresStore],
) -> None:
    api, worker = replicas[0], replicas[1]
    async with _relaying(api) as (heard, listening):
        listening.clear()
        # as a failover or an idle-connection reaper does
        assert await asyncio.to_thread(worker.run, _terminate_backends, LISTENER_NAME) == 1
        async with asyncio.timeout(10):
            await listening.wait()  # listening again
        await _heard(heard, ("", ""))  # notices may have been missed meanwhile: look again
        await asyncio.to_thread(worker.enqueue, [("r.example/app:2", "r.example")])
        await _heard(heard, (JOBS_QUEUED, ""))


@writes
def _terminate_backends(db: Db, application_name: str) -> int:
    rows = db.all(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = :name",
        {"name": application_name},
    )
    return sum(1 for row in rows if row[0])


def test_expired_leases_return_to_the_queue_once(replicas: list[PostgresStore]) -> None:
    store = replicas[0]
    store.enqueue([(f"r.example/app{n}:1", "r.example") for n in range(10)])
    jobs = store.claim_jobs(10, owner="dead-worker", lease_seconds=0.001)
    assert len(jobs) == 10
    with psycopg.connect(store._url) as conn:  # the lease has passed by the database's clock
        conn.execute("SELECT pg_sleep(0.01)")
    expiries = race([replica.expire_leases for replica in replicas])
    returned = [entry for result in expiries if isinstance(result, list) for entry in result]
    assert sorted(entry.job_id for entry in returned) == sorted(job.id for job in jobs)
    assert {entry.owner for entry in returned} == {"dead-worker"}
    assert store.run(queries.queue_depth)["queued"] == 10
    # the dead worker's late outcome is refused: the lease is gone
    assert store.finish_job(jobs[0].id, digest=None, owner="dead-worker") is False
    assert store.fail_job(jobs[0].id, "late", retry_in=1.0, owner="dead-worker") is None


def test_unreachable_database_is_reported_without_the_password(postgres_server: object) -> None:
    from fixtures.registry import free_port

    url = f"postgresql://gpubadge:s3cret-pw@127.0.0.1:{free_port()}/gpubadge"
    with pytest.raises(StoreUnavailable) as caught:
        PostgresStore(url, connect_timeout=2)
    assert "s3cret-pw" not in str(caught.value)


def test_listing_totals_are_exact_up_to_the_limit_then_estimated(
    replicas: list[PostgresStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    from store.queries import reports
    from tests.test_store import _report

    store = replicas[0]
    monkeypatch.setattr(reports, "EXACT_COUNT_LIMIT", 5)
    for n in range(8):
        report = _report("sha256:" + f"{n:x}" * 64, gpu=n < 3)
        store.run(queries.save_report, report.model_copy(update={"registry": f"r{n % 3}.example"}))
    rows, total = store.run(queries.list_images, limit=2)
    assert len(rows) == 2 and total >= 5  # past the limit: an estimate, never below what is proven
    assert store.run(queries.list_images, gpu=True)[1] == 3  # under the limit: exact
    rows, total = store.run(queries.list_images, limit=4, offset=4)
    assert len(rows) == 4 and total == 8  # counting past the page's end is exact again: the last page knows
    assert store.run(queries.registries) == ["r0.example", "r1.example", "r2.example"]  # the index skip-scan
    # the registry is not part of the search text
    assert store.run(queries.list_images, query="R1.EXAMPLE")[1] == 0
    assert store.run(queries.list_images, query="APP:")[1] == 8  # case-insensitive, over the reference


def test_search_reads_its_matches_through_indexes_its_own_names_and_its_tags(
    replicas: list[PostgresStore], postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`q` matches a digest's own names and the names its tags give it. The tags' digests are found through
    their trigram index and handed to the reports' filter as one array, so the planner can serve the OR with
    the reports' trigram index too; the tags' arm was once a subquery run per row, which kept it from doing
    so and read all 1,000,000 reports for every search (1.6 s; bench/RESULTS.md)."""
    from tests.test_store import _report

    store = replicas[0]
    for n in range(4):
        store.run(queries.save_report, _report("sha256:" + f"{n:x}" * 64, gpu=False))
    store.run(queries.record_tag, "mirror.example", "other/name", "v1", "sha256:" + "2" * 64)
    store.run(queries.record_tag, "mirror.example", "gone/name", "v1", "sha256:" + "3" * 64)
    store.run(queries.mark_gone, "mirror.example", "gone/name", tag="v1", digest=None)
    statements: list[tuple[str, Any]] = []
    execute = Db.execute

    def recording(self: Db, sql: str, params: Any = None) -> Any:
        if "ILIKE" in self.dialect.translate(sql) and not sql.startswith("EXPLAIN"):
            statements.append((self.dialect.translate(sql), self._params(params or {})))
        return execute(self, sql, params)

    monkeypatch.setattr(Db, "execute", recording)
    rows, total = store.run(queries.list_images, query="OTHER/NAME")
    assert [row.digest for row in rows] == ["sha256:" + "2" * 64] and total == 1
    assert store.run(queries.list_images, query="gone/name")[1] == 0  # a tag no longer there names nothing
    assert len(statements) >= 2  # the count and the page
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("SET enable_seqscan = off")
        for sql, params in statements:
            plan = "\n".join(row[0] for row in conn.execute("EXPLAIN " + sql, params).fetchall())
            # the tags' digests are one array, computed once: a trigram index can serve the OR's other arm
            assert "= ANY ($" in plan and "hashed SubPlan" not in plan, plan
            assert "Seq Scan on tags" not in plan and "Bitmap Index Scan on tags_search" in plan, plan


async def test_a_wait_on_one_replica_wakes_when_another_process_finishes_the_job(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`?wait=` is event-driven across processes: with the safety re-check pushed out of reach,
    only the NOTIFY from the other replica's commit can end the wait before its timeout."""
    import asyncio

    from store import events, open_store

    monkeypatch.setattr(events, "SAFETY_RECHECK", 600.0)
    api = open_store("unused.db", database_url=postgres_url, threads=2)
    worker = PostgresStore(postgres_url, pool_size=2)
    try:
        await api.start_events()
        assert api.events.cross_process
        (job_id,) = await api.enqueue([("r.example/app:1", "r.example")])
        checks = 0

        async def finished() -> bool:
            nonlocal checks
            checks += 1
            job = await api.run(api.backend.job, job_id)
            if checks == 1:  # the other process claims and finishes it while we wait
                (claimed,) = await asyncio.to_thread(
                    worker.claim_jobs, 1, owner="elsewhere", lease_seconds=60
                )
                await asyncio.to_thread(worker.finish_job, claimed.id, digest=None, owner="elsewhere")
            return job is not None and job.state == "done"

        assert await api.wait_until(finished, timeout=60)
        assert checks == 2  # one look, then one more when the other process's NOTIFY arrived
    finally:
        worker.close()
        await api.close()


@reads
def _in_its_own_statement(db: Db) -> bool:
    """True when the statement is its own transaction: no BEGIN came before it (now() is the
    transaction's start, statement_timestamp() this statement's)."""
    row = db.one("SELECT now() = statement_timestamp()")
    return bool(row and row[0])


@writes
def _in_a_transaction(db: Db) -> bool:
    return not _in_its_own_statement(db)


def test_a_read_is_its_statements_with_no_begin_or_commit_and_a_write_one_transaction(
    replicas: list[PostgresStore],
) -> None:
    """A read costs one round trip a statement, where BEGIN and COMMIT would add two (READ
    COMMITTED gives a transaction's statements no snapshot in common); a write is one transaction."""
    store = replicas[0]
    assert all(store.run(_in_its_own_statement) for _ in range(5))
    assert all(store.run(_in_a_transaction) for _ in range(5))
    assert store.run(queries.job, "no-such-job") is None  # the shared reads run the same way


def test_a_delivery_is_queued_in_one_statement_with_no_transaction_around_it(
    replicas: list[PostgresStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The intake's commit is one round trip (the insert and its NOTIFY), where BEGIN, the insert,
    NOTIFY and COMMIT took four; a reference already queued coalesces with one read more."""
    store = replicas[0]
    store.enqueue(
        [("r.example/warm:1", "r.example")]
    )  # the intake pool's connections, set up before counting
    statements: list[str] = []
    transactions = 0
    execute, transaction = psycopg.Connection.execute, psycopg.Connection.transaction

    def counted_execute(self: psycopg.Connection[Any], query: Any, *args: Any, **kwargs: Any) -> Any:
        statements.append(str(query)[:30])
        return execute(self, query, *args, **kwargs)

    def counted_transaction(self: psycopg.Connection[Any], *args: Any, **kwargs: Any) -> Any:
        nonlocal transactions
        transactions += 1
        return transaction(self, *args, **kwargs)

    monkeypatch.setattr(psycopg.Connection, "execute", counted_execute)
    monkeypatch.setattr(psycopg.Connection, "transaction", counted_transaction)
    first = store.enqueue([("r.example/one:1", "r.example"), ("r.example/two:1", "r.example")])
    assert (len(statements), transactions) == (1, 0)
    again = store.enqueue([("r.example/one:1", "r.example"), ("r.example/three:1", "r.example")])
    assert (len(statements), transactions) == (3, 0)  # the insert, and the read of the coalesced one
    assert again[0] == first[0] and len({*first, *again}) == 3
    monkeypatch.undo()
    assert store.run(queries.queue_depth)["queued"] == 4


async def test_the_webhook_intake_commits_on_the_loop_in_one_statement_with_no_thread(
    replicas: list[PostgresStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No thread stands between a delivery and its record: the intake's statement runs on a
    connection the loop reads, one statement per group, committed when the caller is answered."""
    api, other = replicas[0], replicas[1]
    intake = JobIntake(AsyncStore(api))
    statements: list[str] = []
    execute = psycopg.AsyncConnection.execute

    async def counted(self: psycopg.AsyncConnection[Any], query: Any, *args: Any, **kwargs: Any) -> Any:
        statements.append(str(query)[:30])
        return await execute(self, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.AsyncConnection, "execute", counted)
    try:
        before = {thread.name for thread in threading.enumerate()}
        results = await asyncio.gather(
            *(
                intake.enqueue([(f"r.example/app:{n}", "r.example")], source="test", max_attempts=3)
                for n in range(20)
            )
        )
        assert not {thread.name for thread in threading.enumerate()} - before  # no commit thread started
        assert 0 < len(statements) < 20  # grouped: deliveries that came together share one statement
        # committed when answered: another replica sees every job
        assert all(other.job(ids[0]) is not None for ids in results)
        again = await intake.enqueue([("r.example/app:3", "r.example")], source="test", max_attempts=3)
        assert again == results[3]  # a reference already queued coalesces into its job
    finally:
        await intake.close()


async def test_the_loop_intake_survives_a_cut_connection_and_reports_an_unreachable_server(
    replicas: list[PostgresStore], postgres_server: object
) -> None:
    """A connection cut between deliveries (a failover, an idle reaper) costs no delivery: it is
    tried once more on a new connection. A server out of reach is StoreUnavailable (the 503),
    within the connect timeout and without the password."""
    api, other = replicas[0], replicas[1]
    intake = JobIntake(AsyncStore(api))
    try:
        [first] = await intake.enqueue([("r.example/cut:1", "r.example")], source="test", max_attempts=3)
        assert await asyncio.to_thread(other.run, _terminate_backends, INTAKE_NAME) == 1
        [second] = await intake.enqueue([("r.example/cut:2", "r.example")], source="test", max_attempts=3)
        assert other.job(second) is not None and second != first
    finally:
        await intake.close()

    from fixtures.registry import free_port

    nowhere = LoopIntake(f"postgresql://gpubadge:s3cret-pw@127.0.0.1:{free_port()}/gpubadge", timeout=2)
    async with asyncio.timeout(10):
        with pytest.raises(StoreUnavailable) as caught:
            await nowhere.record([EnqueueBatch([("r.example/app:1", "r.example")])])
    assert "unreachable" in str(caught.value) and "s3cret-pw" not in str(caught.value)
    assert "s3cret-pw" not in caught.value.public


async def test_a_delivery_the_database_does_not_take_in_time_is_refused_and_the_next_goes_through(
    replicas: list[PostgresStore], postgres_url: str
) -> None:
    """Every cost of a delivery is bounded: a statement held up (here by a lock on the jobs table)
    is given up after the store's connect timeout, as StoreUnavailable; once the lock is gone, the
    next delivery is taken on a new connection."""
    other = replicas[1]
    intake = LoopIntake(postgres_url, timeout=1)
    blocker = await psycopg.AsyncConnection.connect(postgres_url)
    try:
        await blocker.execute("LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE")
        async with asyncio.timeout(10):
            with pytest.raises(StoreUnavailable, match="did not take the delivery within 1 s"):
                await intake.record([EnqueueBatch([("r.example/held:1", "r.example")])])
        await blocker.rollback()
        [[job_id]] = await intake.record([EnqueueBatch([("r.example/held:2", "r.example")])])
        assert other.job(job_id) is not None
    finally:
        await blocker.close()
        await intake.close()
