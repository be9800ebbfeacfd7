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

T = TypeVar("T")
log = logging.getLogger(__name__)


def endpoints(ref: Reference, settings: ScannerSettings) -> list[str]:
    """The hosts to ask for `ref`, in order: its mirror (if configured), then its registry."""
    mirror = settings.mirror_for(ref.registry)
    hosts = [ref.api_host]
    if mirror:
        hosts.insert(0, mirror.split("://", 1)[-1].rstrip("/"))
    return hosts


def falls_back(exc: RegistryError) -> bool:
    """True when a mirror's error sends the request on to the registry."""
    return isinstance(exc, NotFound | Unauthorized | TransportError | ServerError | RateLimited)


async def on_endpoints(hosts: list[str], operation: Callable[[str], Awaitable[T]]) -> T:
    """`operation(host)` on each host in turn until one answers (see the module docstring)."""
    for index, host in enumerate(hosts):
        try:
            return await operation(host)
        except RegistryError as exc:
            if index == len(hosts) - 1 or not falls_back(exc):
                raise
            log.warning("mirror %s failed (%s); trying %s", host, exc, hosts[index + 1])
    raise AssertionError("unreachable: no endpoints")
