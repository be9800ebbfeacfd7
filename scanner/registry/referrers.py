"""The OCI referrers protocol, as gpubadge writes and reads it: artifact manifests that point
at the manifests they describe, the referrers API, and the referrers tag schema.

A report artifact (what `scanner.publish` attaches; `build_artifact`) is an OCI image manifest:

- pushed by digest, never tagged; `artifactType` application/vnd.gpubadge.report.v1+json;
- the empty config (`application/vnd.oci.empty.v1+json`, blob `{}` uploaded first);
- one layer, the report JSON (the `gpubadge scan --json` shape, for that manifest);
- `subject`: the scanned manifest's media type, digest and size exactly as the registry
  serves it (size = bytes received, never a re-serialisation);
- string annotations with reverse-DNS keys: `io.gpubadge.report.gpu`, `.cuda`, `.libc`,
  `.platforms`, `.badges`, and `org.opencontainers.image.created`.

A companion artifact (`build_companion_artifact`: NFD's image-compatibility document, say) is
built the same way around its one layer, with `org.opencontainers.image.created` to the
microsecond and `io.gpubadge.generator: gpubadge`.

`ReferrerWriter` pushes them with a registry's push account. Registries with the referrers API
index the subject themselves; we detect that per registry (an `OCI-Subject` header on our PUT,
or a 200 index from `GET /v2/<name>/referrers/<digest>`) and remember it. Elsewhere (Debian's
docker-registry 2.8) we maintain the referrers tag schema: the index tagged `sha256-<hex>`,
read, extended by our entry (every existing entry kept verbatim), PUT back, and read again to
check our entry survived. Our own updates to one tag are serialised with a lock. Other writers
(oras, cosign, notation) can still race us on registries that ignore `If-Match` (Debian's
does): we send `If-Match` with the ETag we read, and the re-read after writing catches a lost
update, which we then redo (bounded). A writer that races us *after* our re-read and drops our
entry can still lose it; that is inherent to the tag schema without conditional PUTs.

Reading back (`list_referrers`, `read_layer`, `newest_of_type`, `read_report`) goes through the
scanner's `RegistryClient` (pull credentials): the API first, else the tag schema; `newest` picks
as NFD's client does (the newest by `org.opencontainers.image.created`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
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
TAG_SCHEMA_ATTEMPTS = 3
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


def artifact_manifest(
    artifact_type: str,
    layer_media_type: str,
    layer: bytes,
    file_name: str,
    subject: Subject,
    annotations: dict[str, str],
) -> bytes:
    """An artifact's manifest bytes: the empty config, its one layer (titled `file_name`), the subject."""
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": artifact_type,
        "config": {"mediaType": EMPTY_MEDIA_TYPE, "digest": EMPTY_DIGEST, "size": len(EMPTY_BLOB)},
        "layers": [
            {
                "mediaType": layer_media_type,
                "digest": compute_digest(layer),
                "size": len(layer),
                "annotations": {TITLE: file_name},
            }
        ],
        "subject": subject.as_json(),
        "annotations": annotations,
    }
    return _serialise(manifest)


def build_artifact(report: ImageReport, subject: Subject) -> ReportArtifact:
    """The referrer manifest for one report about one manifest."""
    report_bytes = report.model_dump_json().encode()
    annotations = summary_annotations(report)
    manifest = artifact_manifest(
        ARTIFACT_TYPE, ARTIFACT_TYPE, report_bytes, REPORT_FILE_NAME, subject, annotations
    )
    return ReportArtifact(report_bytes, manifest, annotations)


@dataclass(frozen=True)
class CompanionContent:
    """The one layer of a companion artifact: its media type, bytes and file name."""

    media_type: str
    data: bytes
    file_name: str


def created_annotation(moment: datetime) -> str:
    """RFC 3339 in UTC with microseconds: what Go's time.Parse(time.RFC3339, ...) reads."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def build_companion_artifact(
    artifact_type: str, content: CompanionContent, subject: Subject, created: datetime
) -> ReportArtifact:
    """A companion's referrer manifest: empty config, its one layer, the subject, created and generator."""
    annotations = {CREATED: created_annotation(created), GENERATOR: GENERATOR_NAME}
    manifest = artifact_manifest(
        artifact_type, content.media_type, content.data, content.file_name, subject, annotations
    )
    return ReportArtifact(content.data, manifest, annotations, artifact_type, content.media_type)


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


Via = Literal["referrers-api", "tag-schema"]


# --- writing, with the push account -------------------------------------------------------


class ReferrerWriter:
    """Writes referrers with a registry's push account: the artifact (blobs, then the manifest by
    digest), indexed by the registry (referrers API, detected per registry and remembered) or by
    us (the tag schema, updated under a lock with `If-Match` and checked by a read-back); and
    reads the subject's referrers of one type as the push account sees them.

    `on_push` is told the digest of everything written (artifacts and tag-schema indexes) before
    it is written, so the caller can recognise the registry's webhook about it.
    """

    def __init__(self, settings: ScannerSettings, *, on_push: Callable[[str], None]) -> None:
        self.settings = settings
        self._on_push = on_push
        self._pushers: dict[str, RegistryPusher] = {}
        self._referrers_api: dict[str, bool] = {}
        self._tag_locks: dict[tuple[str, str, str], asyncio.Lock] = {}

    def pusher(self, host: str) -> RegistryPusher:
        pusher = self._pushers.get(host)
        if pusher is None:
            pusher = self._pushers[host] = RegistryPusher(self.settings, host)
        return pusher

    async def close(self) -> None:
        for pusher in self._pushers.values():
            await asyncio.to_thread(pusher.close)
        self._pushers.clear()

    async def newest_of_type(
        self, pusher: RegistryPusher, repository: str, digest: str, artifact_type: str
    ) -> tuple[Referrer | None, Via]:
        """The newest of the subject's referrers of `artifact_type` (NFD's pick), read with the push account."""
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

    async def push(
        self, pusher: RegistryPusher, repository: str, subject: Subject, artifact: ReportArtifact
    ) -> Via:
        """Push one artifact (blobs, then the manifest by digest) and make sure it is indexed."""
        # Remember before pushing: the registry's webhook can arrive before our PUT returns.
        self._on_push(artifact.digest)
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
        await self.update_tag_schema(pusher, repository, subject.digest, artifact)
        return "tag-schema"

    async def update_tag_schema(
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
                self._on_push(compute_digest(updated))
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


def first_layer_digest(raw: bytes) -> str | None:
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
