"""GitHub Container Registry `registry_package` events (signed with X-Hub-Signature-256)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from web.hooks.common import (
    _HOST_RE,
    Headers,
    ScanRequest,
    Sender,
    WebhookError,
    _blank,
    _Payload,
    _request,
    json_parser,
)
from web.hooks.signatures import GITHUB_SIGNATURE, shared_secret

GHCR_HOST = "ghcr.io"


class _GhcrTag(_Payload):
    name: str | None = None
    digest: str | None = None


class _GhcrContainerMetadata(_Payload):
    tag: _GhcrTag | None = None


class _GhcrPackageVersion(_Payload):
    version: str | None = None
    name: str | None = None
    package_url: str | None = None
    container_metadata: _GhcrContainerMetadata | None = None


class _GhcrOwner(_Payload):
    login: str


class _GhcrPackageHeader(_Payload):
    package_type: str | None = None
    ecosystem: str | None = None


class _GhcrPackage(_Payload):
    name: str
    owner: _GhcrOwner
    package_version: _GhcrPackageVersion


class _GhcrEvent(_Payload):
    action: str


_GHCR_ACTIONS = frozenset({"published", "updated"})

_CONTAINER_PACKAGE_TYPES = frozenset({"container", "docker"})


def normalise(
    payload: dict[str, Any], headers: Headers, default_registry: str | None
) -> Iterable[ScanRequest]:
    """GitHub `package` / `registry_package` events for container packages."""
    event_name = headers.get("x-github-event")
    if event_name == "ping":
        return
    if event_name not in (None, "package", "registry_package"):
        return  # some other GitHub event routed here
    if event_name is None:
        event_name = "package" if "package" in payload else "registry_package"
    if _GhcrEvent.model_validate(payload).action not in _GHCR_ACTIONS:
        return
    if event_name not in payload:
        raise WebhookError(f"ghcr payload: {event_name}: Field required")
    header = _GhcrPackageHeader.model_validate(payload[event_name])
    kinds = {(header.package_type or "").lower(), (header.ecosystem or "").lower()}
    if not kinds & _CONTAINER_PACKAGE_TYPES:
        return  # npm, maven, ... packages
    package = _GhcrPackage.model_validate(payload[event_name])
    version = package.package_version
    tag_info = version.container_metadata.tag if version.container_metadata else None
    tag = _blank(tag_info.name if tag_info else None)
    # The package version *is* the manifest, named by its digest; the tag block repeats it.
    digest = next(
        (d for d in (version.version, version.name) if d and d.startswith("sha256:")),
        _blank(tag_info.digest if tag_info else None),
    )
    host = _ghcr_host(version.package_url) or GHCR_HOST
    repository = f"{package.owner.login}/{package.name}".lower()
    yield _request("ghcr", host, repository, tag, digest, "push")


def _ghcr_host(package_url: str | None) -> str | None:
    """`ghcr.io/Owner/name:tag` -> `ghcr.io` (GitHub Enterprise uses its own containers host)."""
    first = (package_url or "").split("/", 1)[0].lower()
    return first if "." in first and _HOST_RE.match(first) else None


SENDER = Sender(
    "ghcr", parse=json_parser("ghcr", normalise), authenticate=shared_secret("ghcr", GITHUB_SIGNATURE)
)
