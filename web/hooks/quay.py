"""Quay repository push notifications (tags only)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from web.hooks.common import (
    Headers,
    ScanRequest,
    Sender,
    _blank,
    _Payload,
    _request,
    _require_default,
    json_parser,
)
from web.hooks.signatures import shared_secret


class _QuayPush(_Payload):
    repository: str
    docker_url: str | None = None
    updated_tags: list[str] | None = None


def normalise(
    payload: dict[str, Any], headers: Headers, default_registry: str | None
) -> Iterable[ScanRequest]:
    """Quay `repo_push`: one request per updated tag, no digests."""
    push = _QuayPush.model_validate(payload)
    if push.updated_tags is None:
        return  # another repository notification (build, vulnerability) sent to this hook
    host = _blank((push.docker_url or "").split("/", 1)[0])
    host = host or _require_default(default_registry, "quay payload carries no docker_url")
    for tag in push.updated_tags:
        yield _request("quay", host, push.repository, tag, None, "push")


SENDER = Sender("quay", parse=json_parser("quay", normalise), authenticate=shared_secret("quay"))
