"""gpubadge reports as OCI referrers: attached to the scanned manifests, and read back.

With `GPUBADGE_ATTACH_REPORTS=true`, every new report is pushed next to each manifest it
describes (the index and each platform image), as an OCI image manifest:

- pushed by digest, never tagged; `artifactType` application/vnd.gpubadge.report.v1+json;
- the empty config (`application/vnd.oci.empty.v1+json`, blob `{}` uploaded first);
- one layer, the report JSON (the `gpubadge scan --json` shape, for that manifest);
- `subject`: the scanned manifest's media type, digest and size exactly as the registry
  serves it (size = bytes received, never a re-serialisation);
- string annotations with reverse-DNS keys: `io.gpubadge.report.gpu`, `.cuda`, `.libc`,
  `.platforms`, `.badges`, and `org.opencontainers.image.created`.

Registries with the referrers API index the subject themselves; we detect that per registry
(an `OCI-Subject` header on our PUT, or a 200 index from `GET /v2/<name>/referrers/<digest>`)
and remember it. Elsewhere (Debian's docker-registry 2.8) we maintain the referrers tag
schema: the index tagged `sha256-<hex>`, read, extended by our entry (every existing entry
kept verbatim), PUT back, and read again to check our entry survived. Our own updates to
one tag are serialised with a lock. Other writers (oras, cosign, notation) can still race
us on registries that ignore `If-Match` (Debian's does): we send `If-Match` with the ETag
we read, and the re-read after writing catches a lost update, which we then redo (bounded).
A writer that races us *after* our re-read and drops our entry can still lose it; that is
inherent to the tag schema without conditional PUTs.

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
import functools
import json
import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from typing import Any, Literal

from scanner.models import ImageReport, Platform
from scanner.registry.client import RegistryClient
from scanner.registry.descriptors import INDEX_MEDIA_TYPES, Manifest, compute_digest
from scanner.registry.errors import NotFound, RegistryError
from scanner.registry.push import OCI_INDEX, OCI_MANIFEST, PushError, RegistryPusher
from scanner.registry.reference import Reference
from scanner.settings import ScannerSettings

log = logging.getLogger(__name__)

ARTIFACT_TYPE = "application/vnd.gpubadge.report.v1+json"
EMPTY_MEDIA_TYPE = "application/vnd.oci.empty.v1+json"
EMPTY_BLOB = b"{}"
EMPTY_DIGEST = "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
REPORT_FILE_NAME = "gpubadge-report.json"
ANNOTATION_PREFIX = "io.gpubadge.report."
CREATED = "org.opencontainers.image.created"
TITLE = "org.opencontainers.image.title"
GENERATOR = "io.gpubadge.generator"
GENERATOR_NAME = "gpubadge"
LOOKUP_TTL = timedelta(seconds=60)  # how long a read-back of a companion (for the image page) is reused
TAG_SCHEMA_ATTEMPTS = 3
_OWN_REMEMBERED = 10_000
_STATUS_REMEMBERED = 10_000
_ILLEGAL_TAG_CHARS = re.compile(r"[^a-zA-Z0-9_.-]")

assert compute_digest(EMPTY_BLOB) == EMPTY_DIGEST


# --- pure: building the artifact and the tag-schema index ----------------------------------


@dataclass(frozen=True)
class Subject:
    """The scanned manifest as the registry stores it."""

    media_type: str
    digest: str
    size: int

    def as_json(self) -> dict[str, Any]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size}


@dataclass(frozen=True)
class ReportArtifact:
    """The bytes to push. Digests are computed from these exact bytes, which are what we PUT."""

    report: bytes  # the layer's bytes (the report JSON, or a companion's document)
    manifest: bytes
    annotations: dict[str, str]
    artifact_type: str = ARTIFACT_TYPE
    layer_media_type: str = ARTIFACT_TYPE

    @property
    def digest(self) -> str:
        return compute_digest(self.manifest)

    def index_entry(self) -> dict[str, Any]:
        """The descriptor a referrers index lists for this artifact."""
        return {
            "mediaType": OCI_MANIFEST,
            "digest": self.digest,
            "size": len(self.manifest),
            "artifactType": self.artifact_type,
            "annotations": self.annotations,
        }


def summary_annotations(report: ImageReport) -> dict[str, str]:
    """The report's summary as string annotations (reverse-DNS keys), what `oras discover` shows."""
    platforms = report.platforms
    cuda = sorted({p.gpu.cuda_version for p in platforms if p.gpu.cuda_version})
    libc = sorted({p.libc.flavour for p in platforms})
    badges = sorted({badge for p in platforms for badge in p.badges})
    annotations = {
        f"{ANNOTATION_PREFIX}gpu": "true" if report.gpu_required else "false",
        f"{ANNOTATION_PREFIX}libc": ",".join(libc) or "unknown",
        f"{ANNOTATION_PREFIX}platforms": ",".join(p.platform for p in platforms),
        f"{ANNOTATION_PREFIX}badges": ",".join(badges),
        CREATED: report.scanned_at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if cuda:
        annotations[f"{ANNOTATION_PREFIX}cuda"] = ",".join(cuda)
    return annotations


def build_artifact(report: ImageReport, subject: Subject) -> ReportArtifact:
    """The referrer manifest for one report about one manifest."""
    report_bytes = report.model_dump_json().encode()
    annotations = summary_annotations(report)
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": ARTIFACT_TYPE,
        "config": {"mediaType": EMPTY_MEDIA_TYPE, "digest": EMPTY_DIGEST, "size": len(EMPTY_BLOB)},
        "layers": [
            {
                "mediaType": ARTIFACT_TYPE,
                "digest": compute_digest(report_bytes),
                "size": len(report_bytes),
                "annotations": {TITLE: REPORT_FILE_NAME},
            }
        ],
        "subject": subject.as_json(),
        "annotations": annotations,
    }
    return ReportArtifact(report_bytes, _serialise(manifest), annotations)


@dataclass(frozen=True)
class CompanionContent:
    """The one layer of a companion artifact: its media type, bytes and file name."""

    media_type: str
    data: bytes
    file_name: str


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


def created_annotation(moment: datetime) -> str:
    """RFC 3339 in UTC with microseconds: what Go's time.Parse(time.RFC3339, ...) reads."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def build_companion_artifact(
    companion: Companion, content: CompanionContent, subject: Subject, created: datetime
) -> ReportArtifact:
    """A companion's referrer manifest: empty config, its one layer, the subject, created and generator."""
    annotations = {CREATED: created_annotation(created), GENERATOR: GENERATOR_NAME}
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": companion.artifact_type,
        "config": {"mediaType": EMPTY_MEDIA_TYPE, "digest": EMPTY_DIGEST, "size": len(EMPTY_BLOB)},
        "layers": [
            {
                "mediaType": content.media_type,
                "digest": compute_digest(content.data),
                "size": len(content.data),
                "annotations": {TITLE: content.file_name},
            }
        ],
        "subject": subject.as_json(),
        "annotations": annotations,
    }
    return ReportArtifact(
        content.data, _serialise(manifest), annotations, companion.artifact_type, content.media_type
    )


_RFC3339 = re.compile(r"^(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?(Z|[+-]\d{2}:\d{2})$")


def parse_created(text: str | None) -> datetime | None:
    """An `org.opencontainers.image.created` value as Go's time.Parse(time.RFC3339) reads it, or None."""
    match = _RFC3339.match(text or "")
    if match is None:
        return None
    year, month, day, hour, minute, second, fraction, zone = match.groups()
    try:
        offset = (
            timedelta(0)
            if zone == "Z"
            else (-1 if zone[0] == "-" else 1) * timedelta(hours=int(zone[1:3]), minutes=int(zone[4:6]))
        )
        if abs(offset) >= timedelta(hours=24):
            return None
        moment = datetime(
            int(year), int(month), int(day), int(hour), int(minute), int(second), tzinfo=timezone(offset)
        )
    except ValueError:
        return None
    if fraction:
        moment += timedelta(microseconds=int(fraction[:6].ljust(6, "0")))
    return moment


def newest(referrers: list[Referrer]) -> Referrer | None:
    """The referrer NFD's client picks: sorted by `org.opencontainers.image.created`, the last.

    An unreadable or missing time sorts first (Go's zero time); equal times keep index order
    (Go's sort is not stable there, so which of two equal ones NFD picks is not defined).
    """
    zero = datetime.min.replace(tzinfo=UTC)
    ordered = sorted(referrers, key=lambda r: parse_created(r.annotations.get(CREATED)) or zero)
    return ordered[-1] if ordered else None


def tag_schema_tag(digest: str) -> str:
    """`sha256:<hex>` -> `sha256-<hex>`: the referrers tag schema's tag for a subject digest."""
    algorithm, _, encoded = digest.partition(":")
    return f"{_ILLEGAL_TAG_CHARS.sub('-', algorithm)[:32]}-{_ILLEGAL_TAG_CHARS.sub('-', encoded)[:64]}"


class NotAnIndex(ValueError):
    """The tag-schema tag holds something other than an index: leave it alone."""


def index_entries(raw: bytes | None) -> tuple[dict[str, Any], list[Any]]:
    """A tag-schema index split into its top level and its `manifests`; (empty, []) for None."""
    if raw is None:
        return {"schemaVersion": 2, "mediaType": OCI_INDEX}, []
    try:
        data = json.loads(raw)
    except ValueError:
        raise NotAnIndex("the referrers tag holds something that is not JSON") from None
    if (
        not isinstance(data, dict)
        or data.get("mediaType", OCI_INDEX) not in INDEX_MEDIA_TYPES
        or not isinstance(data.get("manifests", []), list)
    ):
        raise NotAnIndex("the referrers tag holds a manifest, not an index")
    entries = data.pop("manifests", [])
    return data, list(entries)


def lists(entries: list[Any], digest: str) -> bool:
    return any(isinstance(entry, dict) and entry.get("digest") == digest for entry in entries)


def with_entry(raw: bytes | None, entry: dict[str, Any]) -> bytes | None:
    """The tag-schema index with `entry` appended and every other entry kept; None if already listed."""
    top, entries = index_entries(raw)
    if lists(entries, entry["digest"]):
        return None
    top.setdefault("schemaVersion", 2)
    top["mediaType"] = OCI_INDEX
    return _serialise({**top, "manifests": [*entries, entry]})


def _serialise(document: dict[str, Any]) -> bytes:
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()


def is_gpubadge_artifact(data: dict[str, Any], also: frozenset[str] = frozenset()) -> bool:
    """A manifest that is one of our reports, or of `also` (companion types): never attach to it."""
    if data.get("artifactType") == ARTIFACT_TYPE or data.get("artifactType") in also:
        return True
    layers = data.get("layers")
    return isinstance(layers, list) and any(
        isinstance(layer, dict) and layer.get("mediaType") == ARTIFACT_TYPE for layer in layers
    )


# --- attaching -------------------------------------------------------------------------------

AttachState = Literal[
    "pending", "attached", "retrying", "failed", "skipped", "reused", "deferred", "found", "absent"
]
Via = Literal["referrers-api", "tag-schema"]


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
        self._own_types = frozenset(c.artifact_type for c in self.companions)
        self._pushers: dict[str, RegistryPusher] = {}
        self._referrers_api: dict[str, bool] = {}
        self._tag_locks: dict[tuple[str, str, str], asyncio.Lock] = {}
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
        if known is not None and (
            known.state not in ("found", "absent") or datetime.now(UTC) - known.updated_at < LOOKUP_TTL
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
            self._set_companion_status(
                digest,
                kind,
                "found",
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
        for pusher in self._pushers.values():
            await asyncio.to_thread(pusher.close)
        self._pushers.clear()

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
        pusher = self._pusher(reference.api_host)
        via = await self._push(pusher, repository, subject, artifact)
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
        pusher = self._pusher(reference.api_host)
        key = (pusher.host, repository, subject.digest, companion.kind)
        async with self._companion_locks.setdefault(key, asyncio.Lock()):
            current, via = await self._newest_companion(
                pusher, repository, subject.digest, companion.artifact_type
            )
            if current is not None:
                fetched = await asyncio.to_thread(
                    pusher.get_manifest, repository, current.digest, OCI_MANIFEST
                )
                if fetched is not None and _first_layer_digest(fetched.raw) == compute_digest(content.data):
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
            artifact = build_companion_artifact(companion, content, subject, report.scanned_at)
            via = await self._push(pusher, repository, subject, artifact)
            return Attached(
                artifact.digest, via, "attached", companion.kind, subject_digest, content.data,
                artifact.annotations[CREATED],
            )  # fmt: skip

    async def _newest_companion(
        self, pusher: RegistryPusher, repository: str, digest: str, artifact_type: str
    ) -> tuple[Referrer | None, Via]:
        """NFD's pick among the subject's referrers of `artifact_type`, read with the push account."""
        raw: bytes | None = None
        via: Via = "tag-schema"
        if self._referrers_api.get(pusher.host) is not False:
            raw = await asyncio.to_thread(pusher.get_referrers, repository, digest)
            if raw is not None:
                via = "referrers-api"
        if raw is None:
            fetched = await asyncio.to_thread(
                pusher.get_manifest, repository, tag_schema_tag(digest), OCI_INDEX
            )
            raw = fetched.raw if fetched is not None else None
        try:
            entries = index_entries(raw)[1] if raw is not None else []
        except NotAnIndex as exc:
            raise PushError(f"{pusher.host}/{repository}: referrers of {digest}: {exc}") from None
        return newest(_referrers_of_type(entries, artifact_type)), via

    async def _push(
        self, pusher: RegistryPusher, repository: str, subject: Subject, artifact: ReportArtifact
    ) -> Via:
        """Push one artifact (blobs, then the manifest by digest) and make sure it is indexed."""
        # Remember before pushing: the registry's webhook can arrive before our PUT returns.
        self._remember(artifact.digest)
        await asyncio.to_thread(pusher.upload_blob, repository, EMPTY_BLOB, EMPTY_MEDIA_TYPE)
        await asyncio.to_thread(pusher.upload_blob, repository, artifact.report, artifact.layer_media_type)
        pushed = await asyncio.to_thread(
            pusher.put_manifest, repository, artifact.digest, artifact.manifest, OCI_MANIFEST
        )
        host = pusher.host
        if pushed.oci_subject:
            self._referrers_api[host] = True
        elif host not in self._referrers_api:
            index = await asyncio.to_thread(pusher.get_referrers, repository, subject.digest)
            self._referrers_api[host] = index is not None
        if self._referrers_api[host]:
            return "referrers-api"
        await self._update_tag_schema(pusher, repository, subject.digest, artifact)
        return "tag-schema"

    async def _update_tag_schema(
        self, pusher: RegistryPusher, repository: str, subject_digest: str, artifact: ReportArtifact
    ) -> None:
        tag = tag_schema_tag(subject_digest)
        lock = self._tag_locks.setdefault((pusher.host, repository, tag), asyncio.Lock())
        async with lock:
            for _ in range(TAG_SCHEMA_ATTEMPTS):
                current = await asyncio.to_thread(pusher.get_manifest, repository, tag, OCI_INDEX)
                try:
                    updated = with_entry(current.raw if current else None, artifact.index_entry())
                except NotAnIndex as exc:
                    raise PushError(f"{pusher.host}/{repository}:{tag}: {exc}; leaving it alone") from None
                if updated is None:
                    return  # already listed
                self._remember(compute_digest(updated))
                etag = current.etag if current is not None else None
                try:
                    await asyncio.to_thread(
                        functools.partial(
                            pusher.put_manifest, repository, tag, updated, OCI_INDEX, if_match=etag
                        )
                    )
                except PushError as exc:
                    if exc.status == 412:
                        continue  # someone wrote between our read and our write: read again
                    raise
                after = await asyncio.to_thread(pusher.get_manifest, repository, tag, OCI_INDEX)
                if after is not None and lists(index_entries(after.raw)[1], artifact.digest):
                    return
                log.warning(
                    "%s/%s:%s: a concurrent writer replaced our update; redoing it",
                    pusher.host,
                    repository,
                    tag,
                )
            raise PushError(f"{pusher.host}/{repository}:{tag}: lost the update to concurrent writers")

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

    def _pusher(self, host: str) -> RegistryPusher:
        pusher = self._pushers.get(host)
        if pusher is None:
            pusher = self._pushers[host] = RegistryPusher(self.settings, host)
        return pusher

    def _remember(self, digest: str) -> None:
        self._own[digest] = None
        self._own.move_to_end(digest)
        while len(self._own) > _OWN_REMEMBERED:
            self._own.popitem(last=False)

    def _set_status(self, digest: str, state: AttachState, **fields: Any) -> None:
        self._status[digest] = AttachStatus(digest, state, **fields)
        self._status.move_to_end(digest)
        while len(self._status) > _STATUS_REMEMBERED:
            self._status.popitem(last=False)

    def _set_companion_status(self, digest: str, kind: str, state: AttachState, **fields: Any) -> None:
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

    def companion_bytes(self) -> int:
        """The bytes the kept companion documents hold (at most `nfd_cache_bytes`)."""
        return self._companion_bytes

    def _count(self, result: AttachResult) -> None:
        if self.on_result is not None:
            self.on_result(result)

    def _count_companion(self, kind: str, result: CompanionResult) -> None:
        if self.on_companion is not None:
            self.on_companion(kind, result)


def _first_layer_digest(raw: bytes) -> str | None:
    """`layers[0].digest` of a manifest (what NFD's client reads), or None."""
    try:
        layers = json.loads(raw).get("layers")
    except (ValueError, AttributeError):
        return None
    if isinstance(layers, list) and layers and isinstance(layers[0], dict):
        digest = layers[0].get("digest")
        return digest if isinstance(digest, str) else None
    return None


def _referrers_of_type(entries: list[Any], artifact_type: str | None) -> list[Referrer]:
    """Index entries as Referrers, those of `artifact_type` only (None: all)."""
    found = []
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("digest"), str):
            continue
        kind = entry.get("artifactType")
        if artifact_type is not None and kind != artifact_type:
            continue
        raw_annotations = entry.get("annotations")
        annotations = (
            {str(k): str(v) for k, v in raw_annotations.items()} if isinstance(raw_annotations, dict) else {}
        )
        found.append(Referrer(entry["digest"], kind if isinstance(kind, str) else None, annotations))
    return found


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


# --- reading back ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Referrer:
    digest: str
    artifact_type: str | None
    annotations: dict[str, str]
    report: dict[str, Any] | None = None


async def list_referrers(
    client: RegistryClient, reference: Reference, *, artifact_type: str | None = ARTIFACT_TYPE
) -> tuple[str, list[Referrer]]:
    """The subject's digest and its referrers (API first, else the tag schema), filtered by type."""
    digest = reference.digest or (await client.resolve(reference)).digest
    index: Manifest | None = await client.referrers(reference, digest)
    if index is None:
        try:
            index = await client.manifest(
                Reference(reference.registry, reference.repository, tag=tag_schema_tag(digest))
            )
        except NotFound:
            return digest, []
    manifests = index.data.get("manifests", [])
    return digest, _referrers_of_type(manifests if isinstance(manifests, list) else [], artifact_type)


async def read_layer(
    client: RegistryClient, reference: Reference, referrer: Referrer, max_bytes: int | None = None
) -> bytes:
    """`layers[0]` of a referrer, as NFD's client reads its artifact (verified, and capped at
    `max_bytes`, else at `max_manifest_bytes`)."""
    manifest = await client.manifest(reference, referrer.digest)
    if not manifest.layers:
        raise RegistryError(f"referrer {referrer.digest} has no layer")
    cap = (
        client.settings.max_manifest_bytes
        if max_bytes is None
        else min(max_bytes, client.settings.max_manifest_bytes)
    )
    return await client.blob(reference, manifest.layers[0].digest, cap)


async def resolve_subject(
    client: RegistryClient, reference: Reference, platform: Platform | None = None
) -> str:
    """The digest a tool like NFD's client attaches to and reads: the tag's (an index stays the index),
    or with `platform` the matching image of an index (oras.Resolve with a target platform)."""
    digest = reference.digest or (await client.resolve(reference)).digest
    if platform is None:
        return digest
    manifest = await client.manifest(reference, digest)
    if not manifest.is_index:
        return digest
    for entry in manifest.manifests:
        if entry.platform is not None and platform.matches(entry.platform):
            return entry.digest
    raise RegistryError(f"{reference}: no {platform} image in its index")


async def newest_of_type(
    client: RegistryClient, reference: Reference, artifact_type: str, platform: Platform | None = None
) -> tuple[str, Referrer | None, bytes | None]:
    """(subject digest, the newest referrer of `artifact_type`, its `layers[0]`): NFD's FetchCompatibilitySpec."""
    subject = await resolve_subject(client, reference, platform)
    pinned = Reference(reference.registry, reference.repository, digest=subject)
    _, found = await list_referrers(client, pinned, artifact_type=artifact_type)
    pick = newest(found)
    if pick is None:
        return subject, None, None
    return subject, pick, await read_layer(client, pinned, pick)


async def read_report(client: RegistryClient, reference: Reference, referrer: Referrer) -> dict[str, Any]:
    """The report JSON inside one of our referrer artifacts (verified and size-capped)."""
    manifest = await client.manifest(reference, referrer.digest)
    layers = [layer for layer in manifest.layers if layer.media_type == ARTIFACT_TYPE]
    if not layers:
        raise RegistryError(f"referrer {referrer.digest} carries no {ARTIFACT_TYPE} layer")
    raw = await client.blob(reference, layers[0].digest, client.settings.max_manifest_bytes)
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise RegistryError(f"referrer {referrer.digest}: the report is not a JSON object")
    return data
