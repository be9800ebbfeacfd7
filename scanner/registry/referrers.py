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
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from scanner.models import ImageReport
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

    report: bytes
    manifest: bytes
    annotations: dict[str, str]

    @property
    def digest(self) -> str:
        return compute_digest(self.manifest)

    def index_entry(self) -> dict[str, Any]:
        """The descriptor a referrers index lists for this artifact."""
        return {
            "mediaType": OCI_MANIFEST,
            "digest": self.digest,
            "size": len(self.manifest),
            "artifactType": ARTIFACT_TYPE,
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


def is_gpubadge_artifact(data: dict[str, Any]) -> bool:
    """A manifest that is one of our reports (never attach to it, never scan it)."""
    if data.get("artifactType") == ARTIFACT_TYPE:
        return True
    layers = data.get("layers")
    return isinstance(layers, list) and any(
        isinstance(layer, dict) and layer.get("mediaType") == ARTIFACT_TYPE for layer in layers
    )


# --- attaching -------------------------------------------------------------------------------

AttachState = Literal["pending", "attached", "retrying", "failed", "skipped"]


@dataclass
class AttachStatus:
    """What the image page shows about one manifest's report referrer."""

    subject: str
    state: AttachState
    attempts: int = 0
    error: str | None = None
    artifact: str | None = None
    via: Literal["referrers-api", "tag-schema"] | None = None
    updated_at: datetime = field(default_factory=lambda: datetime.now(UTC))


@dataclass(frozen=True)
class Attached:
    artifact: str
    via: Literal["referrers-api", "tag-schema"]


AttachResult = Literal["attached", "retry", "failed", "dropped", "skipped"]
NO_PUSH_CREDENTIALS = (
    "not attached: no push credentials for {host} (set registries[].push_username and push_password, "
    "or push_anonymous for a registry open to anonymous pushes)"
)


class ReportAttacher:
    """Attaches reports in the background with its own retries; never raises into the scan path.

    The worker calls `submit(report)` after a successful scan; `start()`/`stop()` bracket the
    service's life. `attach(report)` does one attempt for every manifest the report covers and
    raises on failure (tests and the CLI use it directly).
    """

    def __init__(
        self,
        settings: ScannerSettings,
        client: RegistryClient,
        *,
        on_result: Callable[[AttachResult], None] | None = None,
        concurrency: int = 4,
    ) -> None:
        self.settings = settings
        self.client = client
        self.on_result = on_result
        self._pushers: dict[str, RegistryPusher] = {}
        self._referrers_api: dict[str, bool] = {}
        self._tag_locks: dict[tuple[str, str, str], asyncio.Lock] = {}
        self._own: OrderedDict[str, None] = OrderedDict()
        self._status: OrderedDict[str, AttachStatus] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(concurrency)

    # -- the worker-facing API

    def submit(self, report: ImageReport) -> bool:
        """Queue a finished scan's report for attachment; False when not attached (off, cached, full)."""
        if not self.settings.attach_reports or report.error is not None or report.cached:
            return False
        if not report.digest or not report.registry or not report.repository:
            return False
        entry = self.settings.registry_config(report.registry)
        if entry is None or not entry.may_push():
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

    async def attach_one(
        self, registry: str, repository: str, subject_digest: str, report: ImageReport
    ) -> Attached:
        entry = self.settings.registry_config(registry)
        if entry is None or not entry.may_push():
            raise PushError(NO_PUSH_CREDENTIALS.format(host=registry))
        reference = Reference(registry, repository, digest=subject_digest)
        stored = await self.client.manifest(reference, subject_digest)
        if is_gpubadge_artifact(stored.data):
            raise PushError(f"{subject_digest} is a gpubadge report itself; not attaching to it")
        subject = Subject(stored.media_type, stored.digest, len(stored.raw))
        artifact = build_artifact(report, subject)
        pusher = self._pusher(reference.api_host)
        # Remember before pushing: the registry's webhook can arrive before our PUT returns.
        self._remember(artifact.digest)
        await asyncio.to_thread(pusher.upload_blob, repository, EMPTY_BLOB, EMPTY_MEDIA_TYPE)
        await asyncio.to_thread(pusher.upload_blob, repository, artifact.report, ARTIFACT_TYPE)
        pushed = await asyncio.to_thread(
            pusher.put_manifest, repository, artifact.digest, artifact.manifest, OCI_MANIFEST
        )
        host = reference.api_host
        if pushed.oci_subject:
            self._referrers_api[host] = True
        elif host not in self._referrers_api:
            index = await asyncio.to_thread(pusher.get_referrers, repository, subject.digest)
            self._referrers_api[host] = index is not None
        if self._referrers_api[host]:
            return Attached(artifact.digest, "referrers-api")
        await self._update_tag_schema(pusher, repository, subject.digest, artifact)
        return Attached(artifact.digest, "tag-schema")

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

    def _count(self, result: AttachResult) -> None:
        if self.on_result is not None:
            self.on_result(result)


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
    found = []
    for entry in index.data.get("manifests", []):
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
    return digest, found


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
