"""The job runtime's settings: the store, the scan queue and its workers.

`JobSettings` extends the scanner's settings (registries, credentials, limits) with what the
runtime reads: which store, how many scans at once, leases, retries, the queue's cap. It is all
`gpubadge worker` loads; `web.settings.ServiceSettings` extends it with the HTTP side (listen
address, secrets, webhooks, agents, admission), so every field has one name and one place.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python
from pydantic_settings import SettingsConfigDict

from scanner.registry.reference import DOCKER_HUB, is_loopback
from scanner.settings import ScannerSettings, default_db_path, mirror_parts, sqlite_file_problem
from store import AsyncStore, open_store

MAX_AUTO_PROCESSES = 8  # `auto` stops here: each process holds connections, analysis processes, memory


def usable_cores(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """The cores this process may use: its CPU affinity (a container's cpuset), and no more than its
    cgroup's CPU quota allows (`cpu.max`, a container's `--cpus`), rounded up."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cores


class JobSettings(ScannerSettings):
    """What the job runtime reads. Field descriptions become `--help` text."""

    # A rejected value is never echoed: the database URL carries a password.
    model_config = SettingsConfigDict(**{**ScannerSettings.model_config, "hide_input_in_errors": True})

    db: Path = Field(
        default_factory=default_db_path,
        description="SQLite database file (default $XDG_DATA_HOME/gpubadge/gpubadge.db, as `gpubadge scan`)",
    )
    database_url: SecretStr | None = Field(
        default=None,
        description="postgresql://user:password@host:port/db selects PostgreSQL (no SQLite file is written);"
        " shared by any number of API and worker processes",
    )
    intake_journal: Path | None = Field(
        default=None,
        description="PostgreSQL only: a local file the webhook intake commits each delivery to before its 202,"
        " moved into PostgreSQL moments later, so the answer waits for no round trip and deliveries are taken"
        " while the server is away; its jobs reach other replicas once moved, and it must be on a disk that"
        " outlives the process (SQLite's journal is always <db>-intake)",
    )
    sqlite_synchronous: Literal["NORMAL", "FULL"] = Field(
        default="NORMAL",
        description="NORMAL survives a crash or kill -9; FULL also survives power loss (an fsync per commit)",
    )
    sqlite_busy_timeout: float = Field(
        default=30.0, gt=0, description="seconds a write waits for another process's lock before it fails"
    )
    store_threads: int = Field(
        default=8, ge=1, description="threads that run database calls off the event loop"
    )
    report_cache_entries: int = Field(
        default=512,
        ge=0,
        description="image lookups (reference -> report) kept in memory for placement requests; 0: none",
    )
    report_cache_seconds: float = Field(
        default=30.0,
        gt=0,
        description="longest reuse of a kept lookup when other processes' writes reach this one as"
        " events (PostgreSQL, a shared SQLite file); without them at most 1 s",
    )
    workers: int = Field(
        default=8,
        ge=0,
        description="scans run at once until their config facts (the badge) are published; as many again may"
        " go on reading layers after that, per worker process",
    )
    worker_processes: int | Literal["auto"] = Field(
        default="auto",
        description="processes `serve` runs its scans in, each with `workers` scans at once, restarted when one"
        " dies, so scans never share the API's interpreter or its CPU time; auto: one per two usable cores, at"
        " least 1 and at most 8; 0: scans in the API's own process",
    )
    worker_nice: int = Field(
        default=5,
        ge=0,
        le=19,
        description="how much lower the CPU priority of those worker processes (and their analysis processes) is"
        " than the API's, so webhook answers and API reads never wait for a core behind scans",
    )
    worker_scheduling: Literal["nice", "idle"] = Field(
        default="nice",
        description="how those worker processes share the CPU with the API: nice, worker_nice below it (the"
        " default); idle, Linux's SCHED_IDLE: scans run only on CPU time nothing else on the host wants, so a"
        " webhook's answer (and a registry on the same host) never waits for a core behind a scan, at the cost of"
        " slower scans while the host is busy",
    )
    per_registry_scans: int | None = Field(
        default=None,
        ge=1,
        description="a hard cap on the scans run at once against one registry, across every worker; unset"
        " (the default): none, so a registry alone in the queue gets every worker (work-conserving; fairness"
        " and preempt_after keep one registry from starving another)",
    )
    preempt_after: float = Field(
        default=5.0,
        ge=0,
        description="seconds a registry with ready jobs may wait with no scan in flight while every worker is"
        " busy; past it, a saturated worker puts its longest-running scan of the busiest registry back in the"
        " queue (no attempt spent) and the slot goes to the waiting registry (0: never pre-empt)",
    )
    max_attempts: int = Field(default=5, ge=1, description="scan attempts before a job is marked failed")
    retry_backoff: float = Field(
        default=2.0, ge=0, description="seconds before the first scan retry; doubles"
    )
    drain_seconds: float = Field(
        default=30.0,
        ge=0,
        description="on SIGTERM, how long running scans may finish before they are requeued",
    )
    lease_seconds: float = Field(
        default=30.0,
        gt=0,
        description="a running job's lease; a worker renews it every third of this, and a job whose lease"
        " lapses (crashed or cut-off worker) is claimed again",
    )
    max_queued_scans: int = Field(
        default=100_000,
        ge=1,
        description="scans waiting in the queue; past it deliveries and scan requests are refused (503, Retry-After)"
        " until workers catch up, and nothing already queued is dropped",
    )
    job_retention_seconds: float = Field(
        default=7 * 24 * 3600.0,
        ge=0,
        description="finished scan jobs (done or failed) last updated longer ago than this are deleted (their"
        " reports stay); 0: kept whatever their age",
    )
    job_retention_count: int = Field(
        default=100_000,
        ge=0,
        description="at most this many finished scan jobs are kept, the most recently finished; 0: no cap",
    )
    deployment_retention_seconds: float = Field(
        default=90 * 24 * 3600.0,
        ge=0,
        description="deployments that ended (exited, failed or stopped) last updated longer ago than this are"
        " deleted; 0: kept whatever their age",
    )
    deployment_retention_count: int = Field(
        default=100_000,
        ge=0,
        description="at most this many ended deployments are kept, the most recently updated; 0: no cap",
    )
    inventory_file: Path | None = Field(default=None, description="static fleet (YAML/JSON servers list)")

    @field_validator("worker_processes")
    @classmethod
    def _processes_not_negative(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 0:
            raise ValueError(
                "worker_processes must be auto or a number of processes (0: scans in the API's process)"
            )
        return value

    @classmethod
    def from_payload(cls, payload: bytes) -> JobSettings:
        """The settings `settings_payload` wrote (every field given: nothing read from the environment)."""
        return cls.model_validate(json.loads(payload))

    def worker_process_count(self) -> int:
        """How many worker processes `serve` supervises: the setting, with `auto` resolved against
        the cores this process may run on (one per two, at least 1, at most MAX_AUTO_PROCESSES)."""
        if self.worker_processes != "auto":
            return int(self.worker_processes)
        return max(1, min(MAX_AUTO_PROCESSES, usable_cores() // 2))

    @field_validator("db", mode="before")
    @classmethod
    def _empty_db_is_the_default(cls, value: Any) -> Any:
        """`GPUBADGE_DB=` (set but empty) means the default file, as `gpubadge scan` reads it; a URL
        is refused (`sqlite_file_problem`)."""
        if value is None or (isinstance(value, str) and not value.strip()):
            return default_db_path()
        if isinstance(value, str | Path) and (problem := sqlite_file_problem(str(value))) is not None:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _journal_needs_postgres(self) -> JobSettings:
        if self.intake_journal is not None and self.database_url is None:
            raise ValueError(
                "intake_journal is for PostgreSQL (database_url); SQLite's intake journal is always <db>-intake"
            )
        return self

    @field_validator("database_url")
    @classmethod
    def _postgres_only(cls, value: SecretStr | None) -> SecretStr | None:
        # The message never echoes the URL: it may hold a password.
        if value is not None and not value.get_secret_value().startswith(("postgresql://", "postgres://")):
            raise ValueError("database_url must be a postgresql:// URL (unset means the SQLite file --db)")
        return value

    def allowlist(self) -> set[str]:
        """Registries the service may contact. Mirrors of allowed registries are allowed too."""
        hosts = {entry.host for entry in self.registries}
        hosts |= {mirror_parts(entry.mirror)[0] for entry in self.registries if entry.mirror}
        if self.docker_mirror and (not self.registries or DOCKER_HUB in hosts):
            hosts.add(mirror_parts(self.docker_mirror)[0])
        return hosts

    def allows(self, registry: str) -> bool:
        """The SSRF guard: with no list configured, Docker Hub and loopback registries only."""
        if not self.registries:
            return registry == DOCKER_HUB or is_loopback(registry)
        return registry in self.allowlist()

    @classmethod
    def describe(cls) -> str:
        """One line per setting for `--help`: variable, default, meaning."""
        lines = []
        for name, info in cls.model_fields.items():
            default: Any = info.default
            if info.default_factory is not None:
                default = "(computed)" if name in ("docker_config", "db") else "(empty)"
            shown = "(unset)" if default is None else default
            lines.append(
                f"  GPUBADGE_{name.upper():<28} {info.description or ''} [default: {shown}{_range(info)}]"
            )
        return "\n".join(lines)


def _range(info: FieldInfo) -> str:
    """A numeric setting's range as `--help` shows it after its default: `; at least 1`, `; 0 to 65535`."""
    ge = next((m.ge for m in info.metadata if isinstance(m, annotated_types.Ge)), None)
    gt = next((m.gt for m in info.metadata if isinstance(m, annotated_types.Gt)), None)
    le = next((m.le for m in info.metadata if isinstance(m, annotated_types.Le)), None)
    if ge is not None:
        return f"; {ge} to {le}" if le is not None else f"; at least {ge}"
    if gt is not None:
        return f"; more than {gt}" + (f", at most {le}" if le is not None else "")
    return ""


def port_argument(lowest: int) -> Callable[[str], int]:
    """The argparse type of a command line's TCP port option: `lowest` (0 where the option takes 0 to
    mean any free port, or none) to 65535, so that a port past it is a usage error naming the option,
    never a port the kernel wraps round (99999 would listen on 34463)."""

    def port(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
        if not lowest <= value <= 65535:
            raise argparse.ArgumentTypeError(f"must be {lowest} to 65535")
        return value

    return port


def settings_payload(settings: JobSettings) -> bytes:
    """`settings` as the job runtime reads them, for a worker process `serve` starts: JSON with every
    secret in clear, so it travels only over that child's stdin pipe (never a file, the command line
    or the environment). `JobSettings.from_payload` reads it back."""
    data = settings.model_dump(mode="python", include=set(JobSettings.model_fields))
    return json.dumps(_revealed(data), default=to_jsonable_python).encode()


def _revealed(value: Any) -> Any:
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, dict):
        return {key: _revealed(item) for key, item in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_revealed(item) for item in value]
    return value


def open_job_store(settings: JobSettings, *, shared: bool = False) -> AsyncStore:
    """The store the settings name: PostgreSQL when a database URL is set, else the SQLite file.

    `shared`: this process shares the SQLite file with others that scan or serve it (`serve
    --workers 0` and `gpubadge worker`), so each commit wakes them and theirs wake this one, as
    on PostgreSQL (`store.sqlite_notify`)."""
    return open_store(
        settings.db,
        synchronous=settings.sqlite_synchronous,
        busy_timeout=settings.sqlite_busy_timeout,
        threads=settings.store_threads,
        database_url=settings.database_url.get_secret_value() if settings.database_url else None,
        shared_events=shared,
        report_cache_entries=settings.report_cache_entries,
        report_cache_seconds=settings.report_cache_seconds,
        intake_journal=settings.intake_journal,
    )
