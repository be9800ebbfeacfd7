"""What the store hands out: plain frozen records, never database rows.

Every backend (SQLite, the embedded default; PostgreSQL for scale-out) returns these same types, so
callers never learn which engine is behind the facade.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Literal, NamedTuple

if TYPE_CHECKING:
    from scanner.models import ImageReport, PlatformReport

JobState = Literal["queued", "running", "done", "failed"]
JOB_STATES: tuple[JobState, ...] = ("queued", "running", "done", "failed")


class GpuTaken(Exception):
    """A GPU chosen for a deployment was reserved by another deployment first."""


@dataclass(frozen=True)
class GpuClaims:
    """What a registration (or a report of other GPUs) did with the GPU UUIDs it reported.

    `refused`: GPU UUID -> the server that owns it (nothing was written); `reassigned`: GPU UUID ->
    the server it was taken from (the fleet-wide token's right); `full`: a new server was refused
    because its token has registered its most servers (nothing was written)."""

    refused: dict[str, str] = field(default_factory=dict)
    reassigned: dict[str, str] = field(default_factory=dict)
    full: bool = False

    @property
    def written(self) -> bool:
        return not self.refused and not self.full


class StoreUnavailable(Exception):
    """The database could not be reached or written; the message says why, in words.

    `public` says the same without where (no file path, host name or connection detail), for
    answers to callers who are not operators (/healthz, an API's 503); the message is for the log
    and for operators.
    """

    def __init__(self, message: str, public: str | None = None) -> None:
        super().__init__(message)
        self.public = public if public is not None else "the database is unavailable"


@dataclass(frozen=True)
class EnqueueBatch:
    """The jobs of one delivery: (reference, registry[, delay seconds]) items and their source."""

    references: Sequence[tuple[str, str] | tuple[str, str, float]]
    source: str | None = None
    max_attempts: int = 5
    delay: float = 0.0
    rescan: bool = False  # scan again whatever is stored (coalesces with rescans only)


@dataclass(frozen=True)
class Job:
    """A durable scan job. `lease_owner` is the worker holding it while it runs."""

    id: str
    reference: str
    registry: str
    state: JobState
    attempts: int
    max_attempts: int
    error: str | None
    result_digest: str | None
    source: str | None
    created_at: str
    updated_at: str
    lease_owner: str | None = None
    lease_expires: str | None = None
    rescan: bool = False  # a forced rescan: nothing stored is reused


Stored = tuple["ImageReport | None", "PlatformReport | None"]  # a digest as an image, and as a platform


@dataclass(frozen=True)
class ClaimPass:
    """A worker's claim pass, read in one hop (`AsyncStore.claim_jobs_or_next_due`): the jobs it
    claimed; when the earliest queued job is due (None when none is queued, or when every slot
    was filled); and, by job id, what the store holds for the digest of each claimed job that names
    one (a webhook's job does; a job by tag, or a rescan, is not in it), as `queries.stored` reads it."""

    jobs: list[Job]
    due: datetime | None
    stored: dict[str, Stored]


@dataclass(frozen=True)
class QueueHealth:
    """What /healthz and /metrics need to tell a stalled queue from a busy one."""

    ready: int  # queued jobs whose not_before has passed
    oldest_ready_seconds: float | None  # how long the oldest ready job has waited
    last_progress_seconds: float | None  # since a worker last claimed, finished or failed a job
    running: int


@dataclass(frozen=True)
class LeaseExpiry:
    """A running job whose worker stopped renewing its lease (crashed, lost, or unable to write)."""

    job_id: str
    reference: str
    owner: str
    state: JobState  # queued again, or failed for good once its attempts are spent


@dataclass(frozen=True)
class TagEvent:
    tag: str
    digest: str
    first_seen: str
    last_seen: str
    gone_at: str | None


@dataclass(frozen=True)
class ImageRow:
    """A summary row for listings (one per manifest digest)."""

    digest: str
    registry: str
    repository: str
    reference: str
    gpu_required: bool
    cuda_versions: list[str]
    libc_flavours: list[str]
    platforms: list[str]
    distro: str | None
    scanned_at: str
    tags: list[str]
    platform_badges: list[str] = field(default_factory=list)  # every platform's badges, once each
    # the other names it is tagged under (`registry/repository:tag`), e.g. after a `skopeo copy`
    other_names: list[str] = field(default_factory=list)
    carried_cuda: list[str] = field(default_factory=list)  # CUDA its layers carry (declared: cuda_versions)


class ServerRecord(NamedTuple):
    """A registered server: its inventory document (placement's shape) and liveness."""

    inventory_json: str
    registered_at: str
    last_heartbeat: str


class DeploymentRecord(NamedTuple):
    """A deployment document (placement's shape) with its state and the desired state."""

    record_json: str
    state: str
    desired: str


@dataclass(frozen=True)
class RegistryLoad:
    """One registry's share of the queue, for /metrics: what runs, what waits, and its gate."""

    registry: str
    running: int  # scans in flight against it, every worker counted
    ready: int  # queued jobs whose time has come (they still wait while it cools down)
    cool_down_seconds: float  # until its gate opens again after a Retry-After; 0 when open
