"""Harbor webhooks, in Harbor's default shape and as CloudEvents."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from web.hooks.common import (
    Headers,
    ScanRequest,
    Sender,
    WebhookError,
    _blank,
    _media_type,
    _Payload,
    _request,
    _require_default,
    _url_host,
    json_parser,
)
from web.hooks.signatures import shared_secret

CLOUDEVENTS_MEDIA_TYPE = "application/cloudevents+json"


class _HarborResource(_Payload):
    digest: str | None = None
    tag: str | None = None
    resource_url: str | None = None


class _HarborRepository(_Payload):
    repo_full_name: str


class _HarborEventData(_Payload):
    resources: list[_HarborResource]
    repository: _HarborRepository


class _HarborHeader(_Payload):
    type: str


_HARBOR_ACTIONS: dict[str, Literal["push", "delete"]] = {
    "PUSH_ARTIFACT": "push",
    "DELETE_ARTIFACT": "delete",
    "harbor.artifact.pushed": "push",
    "harbor.artifact.deleted": "delete",
}


def normalise(
    payload: dict[str, Any], headers: Headers, default_registry: str | None
) -> Iterable[ScanRequest]:
    """Harbor, Default (`event_data`) or CloudEvents (`data`, `specversion`) format."""
    cloudevents = _media_type(headers) == CLOUDEVENTS_MEDIA_TYPE or ("specversion" in payload)
    action = _HARBOR_ACTIONS.get(_HarborHeader.model_validate(payload).type)
    if action is None:
        return  # pulls, scans, quotas, replication, retention
    data_key = "data" if cloudevents else "event_data"
    if data_key not in payload:
        raise WebhookError(f"harbor payload: {data_key}: Field required")
    data = _HarborEventData.model_validate(payload[data_key])
    for resource in data.resources:
        digest = _blank(resource.digest)
        tag = _blank(resource.tag)
        if tag is not None and (tag == digest or tag.startswith("sha256:")):
            tag = None  # Harbor repeats the digest as "tag" for pushes by digest
        host = _harbor_host(resource.resource_url)
        yield _request(
            "harbor",
            host or _require_default(default_registry, "harbor resource carries no resource_url"),
            data.repository.repo_full_name,
            tag,
            digest,
            action,
        )


def _harbor_host(resource_url: str | None) -> str | None:
    url = _blank(resource_url)
    if url is None:
        return None
    if "://" in url:
        return _url_host(url)
    return url.split("/", 1)[0] or None


SENDER = Sender("harbor", parse=json_parser("harbor", normalise), authenticate=shared_secret("harbor"))
