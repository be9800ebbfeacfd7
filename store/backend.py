"""The contract every store backend keeps: synchronous, thread-safe, and speaking models.

`SqliteStore` (the embedded default) and `PostgresStore` (scale-out) both implement it;
`AsyncStore` puts either behind async calls, and is what callers use. Callers never see a row
or a cursor.

The queries both engines share are written once in `store.queries` and run through `run`;
what is listed here besides is what really differs per engine: upgrades, health, the job
queue's enqueueing, claims, leases, outcomes and registry gates, and GPU reservations (plus
`job` and `lease_owners`, shared queries kept as methods for synchronous callers).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

from store import queries
from store.dialect import P, Query, T
from store.models import (
    EnqueueBatch,
    Job,
    JobState,
    LeaseExpiry,
    QueueHealth,
    RegistryLoad,
)


class QueryRunner(Protocol):
    """Runs the shared queries (`store.queries`) synchronously: a backend, or `AsyncStore.blocking`."""

    def run(self, query: Query[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run a query function of a connection: a read, or a write in one transaction."""
        ...


class LoopCommits(Protocol):
    """Commits made on the event loop itself, with no thread between a caller and its record: the
    webhook intake's, where the engine has an async driver (PostgreSQL's `LoopIntake`)."""

    async def record(self, batches: Sequence[EnqueueBatch]) -> list[list[str]]:
        """`record_intake` on the loop: committed on return; the job ids per batch."""
        ...

    async def close(self) -> None: ...


class StoreBackend(QueryRunner, Protocol):
    """The engine-specific half of the store; the shared queries (`store.queries`) go through `run`.

    `enqueue`, `job` and `lease_owners` are written once, in `SharedMethods`, which both inherit.
    """

    def upgrade(self) -> int: ...
    def schema_version(self) -> int: ...
    def close(self) -> None: ...
    def check_writable(self, timeout: float) -> None: ...
    def queue_health(self) -> QueueHealth: ...
    def enqueue(
        self,
        references: Sequence[tuple[str, str] | tuple[str, str, float]],
        *,
        source: str | None = None,
        max_attempts: int = 5,
        delay: float = 0.0,
    ) -> list[str]: ...
    def enqueue_many(self, batches: Sequence[EnqueueBatch]) -> list[list[str]]: ...
    def record_intake(self, batches: Sequence[EnqueueBatch]) -> list[list[str]]: ...
    def start_intake(self) -> object: ...
    def queued_for_intake(self, cap: int) -> int: ...
    def tidy_intake(self) -> None: ...
    @property
    def local_reads(self) -> bool: ...
    def intake_unmoved(self) -> int: ...
    def loop_intake(self) -> LoopCommits | None: ...
    def claim_jobs(
        self, limit: int, *, owner: str, lease_seconds: float, per_registry: int | None = None
    ) -> list[Job]: ...
    def renew_leases(self, owner: str, job_ids: Sequence[str], lease_seconds: float) -> list[str]: ...
    def expire_leases(self) -> list[LeaseExpiry]: ...
    def release_leases(self, owners: Sequence[str], *, refund_attempt: bool) -> int: ...
    def preempt_job(self, job_id: str, *, owner: str) -> bool: ...
    def lease_owners(self) -> list[str]: ...
    def finish_job(self, job_id: str, *, digest: str | None, owner: str) -> bool: ...
    def fail_job(self, job_id: str, error: str, *, retry_in: float | None, owner: str) -> JobState | None: ...
    def retry_job(self, job_id: str) -> Job | None: ...
    def job(self, job_id: str) -> Job | None: ...
    def create_deployment(
        self, deployment_id: str, server: str, gpus: Sequence[str], record_json: str
    ) -> None: ...
    def defer_job(self, job_id: str, error: str, *, retry_in: float, owner: str) -> bool: ...
    def registry_load(self) -> list[RegistryLoad]: ...
    def compact_job_tallies(self) -> None: ...


class SharedMethods(ABC):
    """What both backends offer the same way, written once on top of `run` and `enqueue_many`:
    one-call conveniences for synchronous callers (`gpubadge db`, tools, tests), and a job's end
    (the service's workers write it in the batch of their scan results instead)."""

    @abstractmethod
    def run(self, query: Query[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T: ...

    @abstractmethod
    def enqueue_many(self, batches: Sequence[EnqueueBatch]) -> list[list[str]]: ...

    def enqueue(
        self,
        references: Sequence[tuple[str, str] | tuple[str, str, float]],
        *,
        source: str | None = None,
        max_attempts: int = 5,
        delay: float = 0.0,
    ) -> list[str]:
        """Queue (reference, registry[, delay]) jobs in one transaction; returns a job id per item.

        A reference that already has a queued or running job (from any process or replica) is
        coalesced into it, so a burst of N webhooks for one index yields one scan; the partial
        unique index on active dedupe keys decides, not a prior read. A delay (per item, else
        `delay`) holds a job back briefly, so that digest-only child events of a multi-arch push
        run after the index job that covers them.
        """
        return self.enqueue_many([EnqueueBatch(references, source, max_attempts, delay)])[0]

    def job(self, job_id: str) -> Job | None:
        """One job by id (`queries.job`)."""
        return self.run(queries.job, job_id)

    def lease_owners(self) -> list[str]:
        """The workers holding running jobs now (`queries.lease_owners`)."""
        return self.run(queries.lease_owners)

    def finish_job(self, job_id: str, *, digest: str | None, owner: str) -> bool:
        """Mark a job done; False (and nothing written) when `owner` no longer holds its lease
        (`queries.finish_job`)."""
        return self.run(queries.finish_job, job_id, digest=digest, owner=owner)
