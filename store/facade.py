"""The store as the event loop sees it: every call async, every query in a thread.

A locked or slow database then delays only the requests that need it; the loop keeps
serving everything else. The pool is bounded (`threads`). The health check and webhook
intake each have a thread of their own: a pool full of calls stuck behind a lock cannot
hide that lock from /healthz, and a webhook's 202 never waits for a pool thread.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime
from typing import ParamSpec, TypeVar

from scanner.models import ImageReport, PlatformReport
from store.backend import StoreBackend
from store.events import (
    FLEET_CHANNEL,
    FLEET_INVENTORY,
    FLEET_RESERVATIONS,
    JOB_SETTLED_CHANNEL,
    JOBS_QUEUED_CHANNEL,
    QUEUED,
    REPORTED_JOB,
    RESYNC,
    SETTLED,
    QueueEvents,
)
from store.models import (
    DeploymentRecord,
    EnqueueBatch,
    ImageRow,
    Job,
    JobState,
    LeaseExpiry,
    QueueHealth,
    RegistryLoad,
    ServerRecord,
    StoreUnavailable,
    TagEvent,
)

P = ParamSpec("P")
T = TypeVar("T")


class AsyncStore:
    """Async facade over one synchronous backend."""

    def __init__(self, backend: StoreBackend, *, threads: int = 8) -> None:
        self._backend = backend
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="store")
        self._health_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-health")
        self._intake_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-intake")
        self._health_check: tuple[float, Future[None]] | None = None
        self.events = QueueEvents()
        self._stop_listening: Callable[[], None] | None = None

    @property
    def backend(self) -> StoreBackend:
        return self._backend

    async def _call(self, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(function, *args, **kwargs))

    async def close(self) -> None:
        """Wait for calls in flight, then close the backend's connections."""
        await asyncio.get_running_loop().run_in_executor(None, self._shutdown)

    def _shutdown(self) -> None:
        if self._stop_listening is not None:
            self._stop_listening()
        self._intake_pool.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        self._health_pool.shutdown(wait=False, cancel_futures=True)
        self._backend.close()

    async def health(self, timeout: float) -> str | None:
        """None when the database answers and takes a write within `timeout`; else why not, in words.

        Never waits longer than `timeout`. Overlapping callers share one check in flight; a check
        stuck past its own deadline is reported as stuck, never queued behind.
        """
        now = time.monotonic()
        if self._health_check is not None and not self._health_check[1].done():
            started, check = self._health_check
            if now - started > timeout:
                return f"the database has not answered a write check for {now - started:.1f} s"
        else:
            started, check = now, self._health_pool.submit(self._backend.check_writable, timeout)
            self._health_check = (started, check)
        try:
            # shield: one caller giving up must not cancel the check the others share
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(check)), started + timeout + 0.25 - now)
        except TimeoutError:
            return f"the database did not take a write within {timeout:.1f} s"
        except StoreUnavailable as exc:
            return str(exc)
        return None

    async def enqueue(
        self,
        references: Sequence[tuple[str, str] | tuple[str, str, float]],
        *,
        source: str | None = None,
        max_attempts: int = 5,
        delay: float = 0.0,
    ) -> list[str]:
        """One delivery's jobs (see `enqueue_many`)."""
        batch = EnqueueBatch(references, source, max_attempts, delay)
        return (await self.enqueue_many([batch]))[0]

    async def queue_health(self) -> QueueHealth:
        return await self._call(self._backend.queue_health)

    async def save_report(self, report: ImageReport) -> None:
        """Store a report (also a pending one) and wake the long polls on its reference."""
        await self._call(self._backend.save_report, report)
        self._fire_local(SETTLED, f"{REPORTED_JOB} {report.reference}")

    async def report(self, digest: str) -> ImageReport | None:
        return await self._call(self._backend.report, digest)

    async def has_report(self, digest: str) -> bool:
        return await self._call(self._backend.has_report, digest)

    async def platform_report(self, digest: str) -> PlatformReport | None:
        return await self._call(self._backend.platform_report, digest)

    async def list_images(
        self,
        *,
        gpu: bool | None = None,
        libc: str | None = None,
        cuda: str | None = None,
        registry: str | None = None,
        query: str | None = None,
        limit: int = 50,
        offset: int = 0,
        inferred: bool | None = None,
    ) -> tuple[list[ImageRow], int]:
        return await self._call(
            self._backend.list_images,
            gpu=gpu,
            libc=libc,
            cuda=cuda,
            registry=registry,
            query=query,
            limit=limit,
            offset=offset,
            inferred=inferred,
        )

    async def registries(self) -> list[str]:
        return await self._call(self._backend.registries)

    async def record_tag(self, registry: str, repository: str, tag: str, digest: str) -> None:
        return await self._call(self._backend.record_tag, registry, repository, tag, digest)

    async def resolve_tag(self, registry: str, repository: str, tag: str) -> str | None:
        return await self._call(self._backend.resolve_tag, registry, repository, tag)

    async def tag_history(self, registry: str, repository: str) -> list[TagEvent]:
        return await self._call(self._backend.tag_history, registry, repository)

    async def tags_for_digest(self, digest: str) -> list[tuple[str, str, str]]:
        return await self._call(self._backend.tags_for_digest, digest)

    async def mark_gone(self, registry: str, repository: str, *, tag: str | None, digest: str | None) -> None:
        return await self._call(self._backend.mark_gone, registry, repository, tag=tag, digest=digest)

    async def is_gone(self, registry: str, repository: str, digest: str) -> bool:
        return await self._call(self._backend.is_gone, registry, repository, digest)

    async def layer_evidence(self, digest: str) -> str | None:
        return await self._call(self._backend.layer_evidence, digest)

    async def save_layer_evidence(self, digest: str, evidence_json: str) -> None:
        return await self._call(self._backend.save_layer_evidence, digest, evidence_json)

    async def enqueue_many(self, batches: Sequence[EnqueueBatch]) -> list[list[str]]:
        """Webhook intake: its own thread, so it never queues behind scan writes for a pool thread."""
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(self._intake_pool, self._backend.enqueue_many, batches)
        self._fire_local(QUEUED)
        return ids

    async def claim_jobs(
        self, limit: int, *, owner: str, lease_seconds: float, per_registry: int | None = None
    ) -> list[Job]:
        return await self._call(
            self._backend.claim_jobs,
            limit,
            owner=owner,
            lease_seconds=lease_seconds,
            per_registry=per_registry,
        )

    async def renew_leases(self, owner: str, job_ids: Sequence[str], lease_seconds: float) -> list[str]:
        return await self._call(self._backend.renew_leases, owner, job_ids, lease_seconds)

    async def expire_leases(self) -> list[LeaseExpiry]:
        expired = await self._call(self._backend.expire_leases)
        if expired:
            self._fire_local(SETTLED if any(item.state == "failed" for item in expired) else QUEUED)
        return expired

    async def release_leases(self, owners: Sequence[str], *, refund_attempt: bool) -> int:
        released = await self._call(self._backend.release_leases, owners, refund_attempt=refund_attempt)
        if released:
            self._fire_local(QUEUED)
        return released

    async def lease_owners(self) -> list[str]:
        return await self._call(self._backend.lease_owners)

    async def finish_job(self, job_id: str, *, digest: str | None, owner: str) -> bool:
        finished = await self._call(self._backend.finish_job, job_id, digest=digest, owner=owner)
        self._fire_local(SETTLED)
        return finished

    async def fail_job(
        self, job_id: str, error: str, *, retry_in: float | None, owner: str
    ) -> JobState | None:
        state = await self._call(self._backend.fail_job, job_id, error, retry_in=retry_in, owner=owner)
        self._fire_local(QUEUED if state == "queued" else SETTLED)
        return state

    async def retry_job(self, job_id: str) -> Job | None:
        job = await self._call(self._backend.retry_job, job_id)
        if job is not None and job.state == "queued":
            self._fire_local(QUEUED)
        return job

    # ------------------------------------------------------------------ events

    def _fire_local(self, kind: str, payload: str = "") -> None:
        """This process's own write, for its own waiters and workers. With a PostgreSQL listener the
        NOTIFY of the same commit comes back to every process (this one too), keyed by job and
        reference, so firing here as well would only wake everyone a second time."""
        if not self.events.cross_process:
            self.events.fire(kind, payload)

    async def start_events(self) -> None:
        """Deliver queue events on this loop; on PostgreSQL also every replica's (LISTEN).

        Idempotent. Without it, events fired by this process's own writes still reach waiters.
        """
        self.events.bind(asyncio.get_running_loop())
        listen = getattr(self._backend, "listen", None)
        if listen is not None and self._stop_listening is None:
            relay = self.events.fire_threadsafe
            kinds = {JOBS_QUEUED_CHANNEL: QUEUED, JOB_SETTLED_CHANNEL: SETTLED}

            def on_notify(notification: tuple[str, str]) -> None:
                channel, payload = notification
                if channel == FLEET_CHANNEL:
                    relay(FLEET_RESERVATIONS if payload == "reservations" else FLEET_INVENTORY)
                else:
                    relay(kinds.get(channel, RESYNC), payload)

            self._stop_listening = await asyncio.get_running_loop().run_in_executor(None, listen, on_notify)
            self.events.cross_process = True

    async def wait_until(
        self, condition: Callable[[], Awaitable[bool]], timeout: float, key: str | None = None
    ) -> bool:
        """Re-check `condition` whenever a job settles (on any replica, on PostgreSQL); bounded.
        With `key` (a job id or a reference), only when that job or reference settles."""
        return await self.events.wait_until(condition, timeout, key)

    async def wait_for_job(self, job_id: str, timeout: float) -> Job | None:
        """Wait (bounded) until a job is done or failed, whichever process runs it; its latest state."""

        async def settled() -> bool:
            job = await self.job(job_id)
            return job is None or job.state in ("done", "failed")

        await self.wait_until(settled, timeout, key=job_id)
        return await self.job(job_id)

    async def job(self, job_id: str) -> Job | None:
        return await self._call(self._backend.job, job_id)

    async def jobs(self, *, states: Sequence[str] = (), limit: int = 50) -> list[Job]:
        return await self._call(self._backend.jobs, states=states, limit=limit)

    async def pending_job_for(self, reference: str) -> Job | None:
        return await self._call(self._backend.pending_job_for, reference)

    async def latest_job_for(self, reference: str) -> Job | None:
        return await self._call(self._backend.latest_job_for, reference)

    async def queue_depth(self) -> dict[str, int]:
        return await self._call(self._backend.queue_depth)

    async def next_job_due(self) -> datetime | None:
        return await self._call(self._backend.next_job_due)

    async def upsert_server(self, name: str, inventory_json: str) -> None:
        return await self._call(self._backend.upsert_server, name, inventory_json)

    async def heartbeat(self, name: str, inventory_json: str | None = None) -> bool:
        return await self._call(self._backend.heartbeat, name, inventory_json)

    async def servers(self) -> list[ServerRecord]:
        return await self._call(self._backend.servers)

    async def server_inventory(self, name: str) -> str | None:
        return await self._call(self._backend.server_inventory, name)

    async def reserved_gpus(self) -> dict[str, str]:
        return await self._call(self._backend.reserved_gpus)

    async def create_deployment(
        self, deployment_id: str, server: str, gpus: Sequence[str], record_json: str
    ) -> None:
        return await self._call(self._backend.create_deployment, deployment_id, server, gpus, record_json)

    async def deployment(self, deployment_id: str) -> DeploymentRecord | None:
        return await self._call(self._backend.deployment, deployment_id)

    async def deployments(self, *, server: str | None = None, limit: int = 100) -> list[DeploymentRecord]:
        return await self._call(self._backend.deployments, server=server, limit=limit)

    async def update_deployment(
        self,
        deployment_id: str,
        record_json: str,
        *,
        state: str,
        desired: str | None = None,
        release: bool = False,
    ) -> None:
        return await self._call(
            self._backend.update_deployment,
            deployment_id,
            record_json,
            state=state,
            desired=desired,
            release=release,
        )

    async def actionable_deployments(self, server: str) -> list[DeploymentRecord]:
        return await self._call(self._backend.actionable_deployments, server)

    async def defer_job(self, job_id: str, error: str, *, retry_in: float, owner: str) -> bool:
        """Put a job back after its registry's Retry-After and close that registry's gate until then."""
        deferred = await self._call(self._backend.defer_job, job_id, error, retry_in=retry_in, owner=owner)
        self._fire_local(QUEUED)
        return deferred

    async def registry_load(self) -> list[RegistryLoad]:
        return await self._call(self._backend.registry_load)
