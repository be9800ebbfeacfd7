"""Descriptors, manifests and media types: what a registry's JSON says, parsed and checked. Pure.

A `Descriptor` is one entry of a manifest or index (media type, digest, size, platform,
annotations, `urls`). A `Manifest` is a verified manifest or index. The predicates here
decide what a descriptor is to the scanner: a runnable platform image or an attestation,
a layer or an artifact blob, and a layer the registry holds or one it must never be asked
for (foreign and non-distributable layers).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from scanner.models import Platform
from scanner.registry.errors import RegistryError
from scanner.registry.reference import ReferenceError, validate_digest

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST_V2 = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_SCHEMA1 = "application/vnd.docker.distribution.manifest.v1+json"
DOCKER_SCHEMA1_SIGNED = "application/vnd.docker.distribution.manifest.v1+prettyjws"
MANIFEST_MEDIA_TYPES = (OCI_INDEX, OCI_MANIFEST, DOCKER_MANIFEST_LIST, DOCKER_MANIFEST_V2)
INDEX_MEDIA_TYPES = frozenset({OCI_INDEX, DOCKER_MANIFEST_LIST})
SCHEMA1_MEDIA_TYPES = frozenset({DOCKER_SCHEMA1, DOCKER_SCHEMA1_SIGNED})
MANIFEST_ACCEPT = ", ".join(MANIFEST_MEDIA_TYPES)
DOCKER_FOREIGN_LAYER = "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip"
ATTESTATION_PLATFORM = Platform(os="unknown", architecture="unknown")


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    platform: Platform | None = None
    annotations: dict[str, str] = field(default_factory=dict)
    urls: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, data: Any, where: str) -> Descriptor:
        if not isinstance(data, dict):
            raise RegistryError(f"{where}: a descriptor is not a JSON object")
        media_type, digest, size = data.get("mediaType"), data.get("digest"), data.get("size")
        if not isinstance(media_type, str) or not isinstance(digest, str):
            raise RegistryError(f"{where}: a descriptor lacks mediaType or digest")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise RegistryError(f"{where}: descriptor {digest} has an invalid size")
        try:
            validate_digest(digest)
        except ReferenceError as exc:
            raise RegistryError(f"{where}: {exc}") from None
        platform = None
        raw_platform = data.get("platform")
        if isinstance(raw_platform, dict):
            platform = Platform(
                os=str(raw_platform.get("os", "")),
                architecture=str(raw_platform.get("architecture", "")),
                variant=raw_platform.get("variant") or None,
            )
        raw_annotations = data.get("annotations")
        annotations = (
            {str(k): str(v) for k, v in raw_annotations.items()} if isinstance(raw_annotations, dict) else {}
        )
        raw_urls = data.get("urls")
        urls = tuple(str(url) for url in raw_urls) if isinstance(raw_urls, list) else ()
        return cls(media_type, digest, size, platform, annotations, urls)


@dataclass(frozen=True)
class Manifest:
    """A verified manifest or index: its bytes, digest, and parsed JSON."""

    media_type: str
    digest: str
    raw: bytes
    data: dict[str, Any]

    @property
    def is_index(self) -> bool:
        return self.media_type in INDEX_MEDIA_TYPES or "manifests" in self.data

    @property
    def manifests(self) -> list[Descriptor]:
        entries = self.data.get("manifests")
        if not isinstance(entries, list):
            return []
        return [Descriptor.from_json(entry, f"index {self.digest}") for entry in entries]

    @property
    def config(self) -> Descriptor:
        if "config" not in self.data:
            raise RegistryError(f"manifest {self.digest} has no config")
        return Descriptor.from_json(self.data["config"], f"manifest {self.digest}")

    @property
    def layers(self) -> list[Descriptor]:
        entries = self.data.get("layers")
        if not isinstance(entries, list):
            return []
        return [Descriptor.from_json(entry, f"manifest {self.digest}") for entry in entries]

    def descriptor(self) -> Descriptor:
        return Descriptor(self.media_type, self.digest, len(self.raw))


def compute_digest(data: bytes, algorithm: str = "sha256") -> str:
    return f"{algorithm}:{hashlib.new(algorithm, data).hexdigest()}"


def bare_media_type(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


def manifest_media_type(data: dict[str, Any], content_type: str) -> str:
    """The manifest's own `mediaType` wins; else Content-Type; else infer from the shape."""
    declared = data.get("mediaType")
    if isinstance(declared, str) and declared:
        return declared
    if content_type in MANIFEST_MEDIA_TYPES or content_type in SCHEMA1_MEDIA_TYPES:
        return content_type
    if data.get("schemaVersion") == 1:
        return DOCKER_SCHEMA1
    if "manifests" in data:
        return OCI_INDEX
    return OCI_MANIFEST


def is_layer(media_type: str) -> bool:
    """A filesystem layer (any tar flavour), as opposed to an artifact's blob (a chart, a signature)."""
    return "tar" in media_type or media_type.endswith("rootfs.diff.tar.gzip")


def is_attestation(descriptor: Descriptor) -> bool:
    """Buildkit attestations and other non-runnable entries of an index."""
    if descriptor.platform is not None and descriptor.platform == ATTESTATION_PLATFORM:
        return True
    return descriptor.annotations.get("vnd.docker.reference.type") == "attestation-manifest"


def not_distributable(descriptor: Descriptor) -> str | None:
    """Why a layer must never be fetched, or None when the registry holds it.

    Docker's foreign layers (Windows base layers) and OCI's non-distributable layers live
    elsewhere (their `urls`), under terms that forbid redistribution; the registry answers
    BLOB_UNKNOWN for them. Any descriptor with `urls` is treated the same way: gpubadge never
    follows a URL an image author wrote.
    """
    media_type = descriptor.media_type
    if media_type == DOCKER_FOREIGN_LAYER or ".foreign." in media_type:
        return "foreign layer (hosted outside the registry)"
    if ".nondistributable." in media_type:
        return "non-distributable layer"
    if descriptor.urls:
        return "layer with external URLs (never followed)"
    return None
