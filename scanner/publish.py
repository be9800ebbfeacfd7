"""Publishing: what gpubadge attaches to the images it scans, when, and with which account.

The protocol (artifact manifests, the referrers API, the tag schema, reading referrers back)
is `scanner.registry.referrers`; this module decides what goes through it.

With `GPUBADGE_ATTACH_REPORTS=true`, every new, complete report is pushed next to each manifest
it describes (the index and each platform image), with the registry's push account
(`registries[].push_username` / `push_password`, or `push_anonymous`); a registry without one
is skipped, with one warning, and the image page says why.

No loops: the artifacts and indexes we push are remembered (`is_own`), webhook intake drops
push events for them and for any `sha256-…` tag, and the scanner refuses our artifact as
"not an image" (its layer is not a tar), so nothing we push is ever attached to.

A failed attach never fails the scan: `ReportAttacher` retries in the background with
backoff, counts results through `on_result` (for /metrics), and keeps a per-digest status
for the image page. State is in memory; a restart forgets pending attachments.

**Companions.** Beside the report, the attacher pushes the artifacts its `Companion`s build
from the same (complete) report, such as NFD's image-compatibility artifact. The composing
layer (web/) hands them in, so this module knows their media types and bytes, never their
schema. A companion's manifest is built like the report's (empty config, one layer, the
subject) with `org.opencontainers.image.created` to the microsecond (the scan time: a re-scan's
artifact is newer) and `io.gpubadge.generator: gpubadge`. Before pushing one, the attacher does
what NFD's client does: it lists the subject's referrers of that `artifactType` and picks the
newest by `org.opencontainers.image.created` (RFC 3339; a missing or unreadable time counts as
oldest). If that one's `layers[0]` is the same bytes, it is reused and nothing is pushed (no
duplicate on a re-scan with the same verdict). If it was written by another tool, gpubadge
leaves it as the one NFD reads (`deferred`): a person or pipeline that attaches its own
compatibility document knows better. Otherwise the new artifact is pushed and becomes the newest.
Pending reports (`ImageReport.pending`: config facts only) are never attached.

**What is kept of a companion's document.** Its status keeps what the companion's `parse` made
of the layer (bounded, decoded once, in a thread, when it is read or built), never the raw bytes,
and the statuses kept hold at most `nfd_cache_bytes` of documents in all (the oldest go first; a
read-back is simply read again on the next page view).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from scanner.models import ImageReport
from scanner.registry.client import RegistryClient
from scanner.registry.descriptors import compute_digest
from scanner.registry.errors import RegistryError
from scanner.registry.push import OCI_MANIFEST, PushError
from scanner.registry.reference import Reference
from scanner.registry.referrers import (
    CREATED,
    GENERATOR,
    GENERATOR_NAME,
    CompanionContent,
    ReferrerWriter,
    Subject,
    Via,
    build_artifact,
    build_companion_artifact,
    first_layer_digest,
    is_gpubadge_artifact,
    list_referrers,
    newest,
    read_layer,
)
from scanner.settings import ScannerSettings

log = logging.getLogger(__name__)

LOOKUP_TTL = timedelta(seconds=60)  # how long a read-back of a companion (for the image page) is reused
_OWN_REMEMBERED = 10_000
_STATUS_REMEMBERED = 10_000


@dataclass(frozen=True)
class CompanionDocument:
    """What a companion's `parse` made of a layer: a bounded value, and the bytes it holds in memory."""

    value: Any
    cost: int


def _opaque(layer: bytes) -> CompanionDocument:
    return CompanionDocument(None, 0)


@dataclass(frozen=True)
class Companion:
    """An artifact attached beside each report (see the module docstring).

    `build` gets the report about one manifest (the whole report for an index, one platform's
    for a platform image) and returns the layer, or None when that manifest gets none. It must
    be pure and deterministic: the same verdict must give the same bytes. It runs in a thread.
    `parse` turns a layer (gpubadge's or anyone's) into what the status keeps; it must be
    bounded whatever the bytes, never raise, and it runs in a thread. The default keeps nothing.
    """

    kind: str  # "nfd": the key of its status and of its counts
    artifact_type: str
    build: Callable[[ImageReport], CompanionContent | None]
    parse: Callable[[bytes], CompanionDocument] = _opaque
    max_bytes: int | None = None  # the largest layer read back (None: max_manifest_bytes)


AttachState = Literal[
    "pending", "attached", "retrying", "failed", "skipped", "reused", "deferred", "found", "absent"
]


@dataclass
class AttachStatus:
    """What the image page shows about one manifest's report referrer (or one companion's).

    Companions add `reused` (the newest artifact already said the same), `deferred` (another
    tool's artifact is the newest; left as it is), and, read back for the page when this process
    did not attach it, `found` / `absent`. `document` is what the companion's `parse` made of
    its layer (never the raw bytes).
    """

    subject: str
    state: AttachState
    attempts: int = 0
    error: str | None = None
    artifact: str | None = None
    via: Via | None = None
    kind: str = "report"
    document: CompanionDocument | None = None
    created: str | None = None
    updated_at: datetime = field(default_factory=lambda: datetime.now(UTC))


@dataclass(frozen=True)
class Attached:
    artifact: str
    via: Via
    outcome: Literal["attached", "reused", "deferred"] = "attached"
    kind: str = "report"
    subject: str = ""
    layer: bytes | None = None
    created: str | None = None


AttachResult = Literal["attached", "retry", "failed", "dropped", "skipped"]
CompanionResult = Literal["attached", "reused", "deferred", "retry", "failed"]
NO_PUSH_CREDENTIALS = (
    "not attached: no push credentials for {host} (set registries[].push_username and push_password, "
    "or push_anonymous for a registry open to anonymous pushes)"
)


class ReportAttacher:
    """Attaches reports (and their companions) in the background with its own retries; never raises
    into the scan path.

    The worker calls `submit(report)` after a successful scan; `stop()` ends the service's life.
    `attach(report)` and `attach_companions(report)` do one attempt for every manifest the report
    covers and raise on failure (tests and the CLI use them directly).
    """

    def __init__(
        self,
        settings: ScannerSettings,
        client: RegistryClient,
        *,
        on_result: Callable[[AttachResult], None] | None = None,
        companions: Sequence[Companion] = (),
        on_companion: Callable[[str, CompanionResult], None] | None = None,
        concurrency: int = 4,
    ) -> None:
        self.settings = settings
        self.client = client
        self.on_result = on_result
        self.companions = tuple(companions)
        self.on_companion = on_companion
        # A worker process of `serve` tells it what it pushed and how attachments stand (jobs/worker_reports.py).
        self.on_own: Callable[[str], None] | None = None
        self.on_status: Callable[[AttachStatus], None] | None = None
        self._own_types = frozenset(c.artifact_type for c in self.companions)
        self.writer = ReferrerWriter(settings, on_push=self._remember)
        self._companion_locks: dict[tuple[str, str, str, str], asyncio.Lock] = {}
        self._own: OrderedDict[str, None] = OrderedDict()
        self._status: OrderedDict[str, AttachStatus] = OrderedDict()
        self._companion_status: OrderedDict[tuple[str, str], AttachStatus] = OrderedDict()
        self._companion_bytes = 0  # the documents the companion statuses hold (nfd_cache_bytes)
        self._tasks: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(concurrency)
        # Registries already warned about lacking push credentials: one WARNING each, not one per
        # scan. Bounded by the registries a scan may reach (the allowlist).
        self._warned_no_push: set[str] = set()

    # -- the worker-facing API

    def submit(self, report: ImageReport) -> bool:
        """Queue a finished scan's report for attachment; False when not attached (off, cached, full).

        A pending report (config facts only, layers still being read) is never attached: its
        complete successor is, moments later.
        """
        if not self.settings.attach_reports or report.error is not None or report.cached or report.pending:
            return False
        if not report.digest or not report.registry or not report.repository:
            return False
        entry = self.settings.registry_config(report.registry)
        if entry is None or not entry.may_push():
            if report.registry not in self._warned_no_push:
                self._warned_no_push.add(report.registry)
                log.warning(
                    "reports are %s; logged once per registry",
                    NO_PUSH_CREDENTIALS.format(host=report.registry),
                )
            for subject_digest, _ in _per_manifest(report):
                self._set_status(
                    subject_digest, "skipped", error=NO_PUSH_CREDENTIALS.format(host=report.registry)
                )
            self._count("skipped")
            return False
        if len(self._tasks) >= self.settings.attach_queue_max:
            self._count("dropped")
            self._set_status(report.digest, "failed", error="attach queue full; report not attached")
            return False
        for subject_digest, _ in _per_manifest(report):
            self._set_status(subject_digest, "pending")
        task = asyncio.get_running_loop().create_task(self._attach_with_retries(report))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    def status(self, digest: str) -> AttachStatus | None:
        return self._status.get(digest)

    def companion_status(self, digest: str, kind: str) -> AttachStatus | None:
        """What this process did (or read back) about a companion of `digest`."""
        return self._companion_status.get((digest, kind))

    async def lookup_companion(
        self, registry: str, repository: str, digest: str, kind: str
    ) -> AttachStatus | None:
        """The companion's status; read back from the registry (as NFD reads it) when this process
        has none, or a read-back is older than LOOKUP_TTL. Raises RegistryError on registry faults."""
        companion = next((c for c in self.companions if c.kind == kind), None)
        known = self._companion_status.get((digest, kind))
        if companion is None:
            return known
        # A worker process's attachment (its document stayed there): read the document back, keep its state.
        elsewhere = known is not None and known.document is None and known.state in ("attached", "reused")
        if (
            known is not None
            and not elsewhere
            and (known.state not in ("found", "absent") or datetime.now(UTC) - known.updated_at < LOOKUP_TTL)
        ):
            return known
        reference = Reference(registry, repository, digest=digest)
        _, found = await list_referrers(self.client, reference, artifact_type=companion.artifact_type)
        pick = newest(found)
        if pick is None:
            self._set_companion_status(digest, kind, "absent")
        else:
            layer = await read_layer(self.client, reference, pick, companion.max_bytes)
            document = await asyncio.to_thread(companion.parse, layer)  # once, off the event loop
            del layer  # only the parsed, bounded document is kept
            state: AttachState = known.state if elsewhere and known is not None else "found"
            self._set_companion_status(
                digest,
                kind,
                state,
                artifact=pick.digest,
                document=document,
                created=pick.annotations.get(CREATED),
            )
        return self._companion_status.get((digest, kind))

    def is_own(self, digest: str | None, tag: str | None = None) -> bool:
        """A push event about something we pushed (or any referrers tag) must not queue a scan."""
        if tag is not None and tag.startswith("sha256-"):
            return True
        return digest is not None and digest in self._own

    async def wait_idle(self, timeout: float) -> bool:
        """Wait (bounded) for queued attachments to finish; True if none is left."""
        tasks = set(self._tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        return not self._tasks

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.writer.close()

    # -- one attempt

    async def attach(self, report: ImageReport) -> list[Attached]:
        """Attach `report` to each manifest it covers (the index, then each platform image)."""
        assert report.registry and report.repository
        results = []
        for subject_digest, subject_report in _per_manifest(report):
            results.append(
                await self.attach_one(report.registry, report.repository, subject_digest, subject_report)
            )
        return results

    async def attach_companions(self, report: ImageReport) -> list[Attached]:
        """Every companion of `report`, on each manifest it covers that gets one (one attempt each)."""
        assert report.registry and report.repository
        results = []
        for subject_digest, subject_report in _per_manifest(report):
            for companion in self.companions:
                content = await asyncio.to_thread(companion.build, subject_report)
                if content is not None:
                    results.append(
                        await self.attach_companion(
                            report.registry,
                            report.repository,
                            subject_digest,
                            subject_report,
                            companion,
                            content,
                        )
                    )
        return results

    async def _subject(
        self, registry: str, repository: str, subject_digest: str
    ) -> tuple[Reference, Subject]:
        entry = self.settings.registry_config(registry)
        if entry is None or not entry.may_push():
            raise PushError(NO_PUSH_CREDENTIALS.format(host=registry))
        reference = Reference(registry, repository, digest=subject_digest)
        stored = await self.client.manifest(reference, subject_digest)
        if is_gpubadge_artifact(stored.data, self._own_types):
            raise PushError(f"{subject_digest} is a gpubadge report itself; not attaching to it")
        return reference, Subject(stored.media_type, stored.digest, len(stored.raw))

    async def attach_one(
        self, registry: str, repository: str, subject_digest: str, report: ImageReport
    ) -> Attached:
        reference, subject = await self._subject(registry, repository, subject_digest)
        artifact = build_artifact(report, subject)
        pusher = self.writer.pusher(reference.api_host)
        via = await self.writer.push(pusher, repository, subject, artifact)
        return Attached(artifact.digest, via, subject=subject_digest)

    async def attach_companion(
        self,
        registry: str,
        repository: str,
        subject_digest: str,
        report: ImageReport,
        companion: Companion,
        content: CompanionContent,
    ) -> Attached:
        """Reuse the newest artifact of the companion's type when it holds these bytes, defer to another
        tool's, else push a new one (see the module docstring)."""
        reference, subject = await self._subject(registry, repository, subject_digest)
        pusher = self.writer.pusher(reference.api_host)
        key = (pusher.host, repository, subject.digest, companion.kind)
        async with self._companion_locks.setdefault(key, asyncio.Lock()):
            current, via = await self.writer.newest_of_type(
                pusher, repository, subject.digest, companion.artifact_type
            )
            if current is not None:
                fetched = await asyncio.to_thread(
                    pusher.get_manifest, repository, current.digest, OCI_MANIFEST
                )
                if fetched is not None and first_layer_digest(fetched.raw) == compute_digest(content.data):
                    self._remember(current.digest)
                    return Attached(
                        current.digest, via, "reused", companion.kind, subject_digest, content.data,
                        current.annotations.get(CREATED),
                    )  # fmt: skip
                if current.annotations.get(GENERATOR) != GENERATOR_NAME:
                    return Attached(
                        current.digest, via, "deferred", companion.kind, subject_digest, None,
                        current.annotations.get(CREATED),
                    )  # fmt: skip
            artifact = build_companion_artifact(companion.artifact_type, content, subject, report.scanned_at)
            via = await self.writer.push(pusher, repository, subject, artifact)
            return Attached(
                artifact.digest, via, "attached", companion.kind, subject_digest, content.data,
                artifact.annotations[CREATED],
            )  # fmt: skip

    # -- background retries

    async def _attach_with_retries(self, report: ImageReport) -> None:
        assert report.registry and report.repository
        for subject_digest, subject_report in _per_manifest(report):
            await self._attach_subject(report.registry, report.repository, subject_digest, subject_report)
            for companion in self.companions:
                await self._attach_companion_subject(
                    report.registry, report.repository, subject_digest, subject_report, companion
                )

    async def _attach_subject(
        self, registry: str, repository: str, subject_digest: str, report: ImageReport
    ) -> None:
        attempts = self.settings.attach_attempts
        for attempt in range(1, attempts + 1):
            async with self._slots:
                try:
                    done = await self.attach_one(registry, repository, subject_digest, report)
                except asyncio.CancelledError:
                    raise
                except (RegistryError, PushError, OSError) as exc:
                    error = str(exc)
                except Exception as exc:  # an attach must never take the service down
                    log.exception("attaching the report to %s failed unexpectedly", subject_digest)
                    error = f"internal error: {type(exc).__name__}"
                else:
                    self._set_status(
                        subject_digest, "attached", attempts=attempt, artifact=done.artifact, via=done.via
                    )
                    self._count("attached")
                    return
            final = attempt == attempts
            self._set_status(subject_digest, "failed" if final else "retrying", attempts=attempt, error=error)
            self._count("failed" if final else "retry")
            log.warning(
                "attaching the report to %s/%s@%s failed (attempt %d of %d): %s",
                registry,
                repository,
                subject_digest,
                attempt,
                attempts,
                error,
            )
            if not final:
                await asyncio.sleep(self.settings.attach_backoff * 2 ** (attempt - 1))

    async def _attach_companion_subject(
        self, registry: str, repository: str, subject_digest: str, report: ImageReport, companion: Companion
    ) -> None:
        """One companion on one manifest, with the report's retry budget; its own status and counts."""
        kind = companion.kind
        try:
            content = await asyncio.to_thread(companion.build, report)
        except Exception as exc:  # a builder bug must not take the service down
            log.exception("building the %s artifact for %s failed", kind, subject_digest)
            self._set_companion_status(
                subject_digest, kind, "failed", error=f"internal error: {type(exc).__name__}"
            )
            self._count_companion(kind, "failed")
            return
        if content is None:
            self._companion_status.pop((subject_digest, kind), None)
            return
        document = await asyncio.to_thread(companion.parse, content.data)
        self._set_companion_status(subject_digest, kind, "pending", document=document)
        attempts = self.settings.attach_attempts
        for attempt in range(1, attempts + 1):
            async with self._slots:
                try:
                    done = await self.attach_companion(
                        registry, repository, subject_digest, report, companion, content
                    )
                except asyncio.CancelledError:
                    raise
                except (RegistryError, PushError, OSError) as exc:
                    error = str(exc)
                except Exception as exc:
                    log.exception("attaching the %s artifact to %s failed unexpectedly", kind, subject_digest)
                    error = f"internal error: {type(exc).__name__}"
                else:
                    note = (
                        f"another tool's {companion.artifact_type} artifact is the newest; gpubadge leaves it "
                        "as the one NFD reads"
                        if done.outcome == "deferred"
                        else None
                    )
                    self._set_companion_status(
                        subject_digest, kind, done.outcome, attempts=attempt, artifact=done.artifact, via=done.via,
                        document=document if done.layer is not None else None, created=done.created,
                        error=note,
                    )  # fmt: skip
                    self._count_companion(kind, done.outcome)
                    return
            final = attempt == attempts
            self._set_companion_status(
                subject_digest,
                kind,
                "failed" if final else "retrying",
                attempts=attempt,
                error=error,
                document=document,
            )
            self._count_companion(kind, "failed" if final else "retry")
            log.warning(
                "attaching the %s artifact to %s/%s@%s failed (attempt %d of %d): %s",
                kind, registry, repository, subject_digest, attempt, attempts, error,
            )  # fmt: skip
            if not final:
                await asyncio.sleep(self.settings.attach_backoff * 2 ** (attempt - 1))

    # -- bookkeeping

    def _remember(self, digest: str) -> None:
        self.note_own(digest)
        if self.on_own is not None:
            self.on_own(digest)

    def note_own(self, digest: str) -> None:
        """`digest` is an artifact gpubadge pushed (here, or in a worker process of this service)."""
        self._own[digest] = None
        self._own.move_to_end(digest)
        while len(self._own) > _OWN_REMEMBERED:
            self._own.popitem(last=False)

    def _set_status(self, digest: str, state: AttachState, **fields: Any) -> None:
        status = AttachStatus(digest, state, **fields)
        self.note_status(status)
        if self.on_status is not None:
            self.on_status(status)

    def note_status(self, status: AttachStatus) -> None:
        """Where a report's (or a companion's) attachment stands (here, or in a worker process of
        this service: a companion's document stays there, and `lookup_companion` reads it back)."""
        if status.kind != "report":
            fields = {
                name: getattr(status, name) for name in ("attempts", "error", "artifact", "via", "created")
            }
            self._keep_companion_status(status.subject, status.kind, status.state, **fields, document=None)
            return
        self._status[status.subject] = status
        self._status.move_to_end(status.subject)
        while len(self._status) > _STATUS_REMEMBERED:
            self._status.popitem(last=False)

    def _set_companion_status(self, digest: str, kind: str, state: AttachState, **fields: Any) -> None:
        status = self._keep_companion_status(digest, kind, state, **fields)
        if self.on_status is not None:
            self.on_status(status)

    def _keep_companion_status(
        self, digest: str, kind: str, state: AttachState, **fields: Any
    ) -> AttachStatus:
        """Keep the status; the oldest go past _STATUS_REMEMBERED entries or `nfd_cache_bytes` of documents.

        A document larger than the whole cap is not kept (the status says so); the page then
        reads it again, each time within the same bounds.
        """
        key = (digest, kind)
        cap = self.settings.nfd_cache_bytes
        document: CompanionDocument | None = fields.get("document")
        if document is not None and document.cost > cap:
            fields["document"] = None
            fields["error"] = fields.get("error") or (
                f"its document ({document.cost:,} bytes in memory) is larger than nfd_cache_bytes ({cap:,}); not kept"
            )
        old = self._companion_status.pop(key, None)
        if old is not None and old.document is not None:
            self._companion_bytes -= old.document.cost
        status = AttachStatus(digest, state, kind=kind, **fields)
        self._companion_status[key] = status
        if status.document is not None:
            self._companion_bytes += status.document.cost
        while len(self._companion_status) > 1 and (
            len(self._companion_status) > _STATUS_REMEMBERED or self._companion_bytes > cap
        ):
            _, dropped = self._companion_status.popitem(last=False)
            if dropped.document is not None:
                self._companion_bytes -= dropped.document.cost
        return status

    def companion_bytes(self) -> int:
        """The bytes the kept companion documents hold (at most `nfd_cache_bytes`)."""
        return self._companion_bytes

    def _count(self, result: AttachResult) -> None:
        if self.on_result is not None:
            self.on_result(result)

    def _count_companion(self, kind: str, result: CompanionResult) -> None:
        if self.on_companion is not None:
            self.on_companion(kind, result)


def _per_manifest(report: ImageReport) -> list[tuple[str, ImageReport]]:
    """(digest, report about that manifest): the whole report for the top manifest, one per platform."""
    assert report.digest
    pairs = [(report.digest, report)]
    for platform in report.platforms:
        if platform.digest != report.digest:
            pairs.append(
                (
                    platform.digest,
                    report.model_copy(
                        update={"digest": platform.digest, "platforms": [platform], "media_type": None}
                    ),
                )
            )
    return pairs
