"""JFrog Artifactory Docker webhooks (the default registry names the host)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from pydantic import field_validator

from web.hooks.common import (
    Headers,
    ScanRequest,
    Sender,
    WebhookError,
    _Payload,
    _request,
    _short,
    json_parser,
)
from web.hooks.signatures import JFROG_SIGNATURE, shared_secret


class _JfrogHeader(_Payload):
    domain: str
    event_type: str


class _JfrogData(_Payload):
    repo_key: str
    tag: str
    sha256: str | None = None
    path: str | None = None
    name: str | None = None
    image_name: str | None = None

    @field_validator("sha256")
    @classmethod
    def _bare_hex(cls, value: str | None) -> str | None:
        if value is not None and (len(value) != 64 or value.strip("0123456789abcdef")):
            raise ValueError("expected 64 lowercase hex characters (the manifest's sha256)")
        return value


class _JfrogEvent(_Payload):
    data: _JfrogData


_JFROG_ACTIONS: dict[str, Literal["push", "delete"]] = {"pushed": "push", "deleted": "delete"}

_JFROG_MANIFEST_FILES = frozenset({"manifest.json", "list.manifest.json"})


def normalise(
    payload: dict[str, Any], headers: Headers, default_registry: str | None
) -> Iterable[ScanRequest]:
    """Artifactory `docker` domain events; repository-path access (`host/<repo_key>/<image>`)."""
    header = _JfrogHeader.model_validate(payload)
    action = _JFROG_ACTIONS.get(header.event_type)
    if header.domain != "docker" or action is None:
        return  # artifact/build domains, promotions
    if not default_registry:
        raise WebhookError(
            "jfrog payloads do not reliably name the registry host (jpd_origin is often missing); "
            "configure the Artifactory Docker host as the default registry for this hook"
        )
    data = _JfrogEvent.model_validate(payload).data
    image = _jfrog_image_path(data)
    digest = f"sha256:{data.sha256}" if data.sha256 else None
    yield _request("jfrog", default_registry, f"{data.repo_key}/{image}", data.tag, digest, action)


def _jfrog_image_path(data: _JfrogData) -> str:
    """`foo/bar/busybox/latest/manifest.json` -> `foo/bar/busybox`; image_name drops `foo/bar`."""
    if data.path:
        parts = data.path.strip("/").split("/")
        if len(parts) >= 3 and parts[-1] in _JFROG_MANIFEST_FILES and parts[-2] == data.tag:
            return "/".join(parts[:-2])
        raise WebhookError(
            f"jfrog payload: data.path {_short(data.path)} is not <image>/<tag>/<manifest file>"
        )
    if data.image_name:
        return data.image_name
    raise WebhookError("jfrog payload: neither data.path nor data.image_name names the image")


SENDER = Sender(
    "jfrog",
    parse=json_parser("jfrog", normalise),
    authenticate=shared_secret("jfrog", JFROG_SIGNATURE),
    default_registry_setting="jfrog_registry",
)
