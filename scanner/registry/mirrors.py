"""Pull-through mirrors: ask the configured mirror first, the registry itself if the mirror fails.

A mirror (`registries[].mirror`) serves the same content under the same names. When it
answers "not here", "not for you", or not at all, the request goes to the registry; any other
error (a digest mismatch, a manifest too large) is an answer about the content and stands.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from scanner.registry.errors import (
    NotFound,
    RateLimited,
    RegistryError,
    ServerError,
    TransportError,
    Unauthorized,
)
from scanner.registry.reference import Reference
from scanner.settings import ScannerSettings
from scanner.settings_merge import redact_userinfo

T = TypeVar("T")
log = logging.getLogger(__name__)


def endpoints(ref: Reference, settings: ScannerSettings) -> list[str]:
    """The hosts to ask for `ref`, in order: its mirror (if configured), then its registry."""
    mirror = settings.mirror_for(ref.registry)  # host[:port]: its user info is a credential
    return [mirror, ref.api_host] if mirror else [ref.api_host]


def falls_back(exc: RegistryError) -> bool:
    """True when a mirror's error sends the request on to the registry."""
    return isinstance(exc, NotFound | Unauthorized | TransportError | ServerError | RateLimited)


def _without_userinfo(exc: RegistryError, host: str) -> RegistryError:
    """A mirror configured as `user:password@host` names itself in its errors: redact the password
    there (the error may become a job's error, shown in the API and the UI)."""
    shown = redact_userinfo(host)
    if shown != host:
        exc.args = (redact_userinfo(str(exc).replace(host, shown)), *exc.args[1:])
        exc.host = shown
    return exc


async def on_endpoints(hosts: list[str], operation: Callable[[str], Awaitable[T]]) -> T:
    """`operation(host)` on each host in turn until one answers (see the module docstring).

    A mirror's password (`user:password@mirror`) never reaches a warning or an error's text."""
    for index, host in enumerate(hosts):
        try:
            return await operation(host)
        except RegistryError as exc:
            _without_userinfo(exc, host)
            if index == len(hosts) - 1 or not falls_back(exc):
                raise
            log.warning(
                "mirror %s failed (%s); trying %s",
                redact_userinfo(host),
                exc,
                redact_userinfo(hosts[index + 1]),
            )
    raise AssertionError("unreachable: no endpoints")
