"""Counting what a scan costs: requests, bytes received, token fetches and retries.

`track()` opens a counting block; every request made inside it (and in tasks started from
it) is added to that block and to the client's running totals. Bytes are counted as the
transport hands them over, so a read stopped early still counts every byte that arrived.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass
class RequestStats:
    """Requests made inside one `track()` block. Token fetches are counted apart."""

    requests: int = 0
    bytes_received: int = 0
    token_requests: int = 0
    retries: int = 0


_active_stats: ContextVar[tuple[RequestStats, ...]] = ContextVar("gpubadge_request_stats", default=())


def count(
    totals: RequestStats,
    *,
    requests: int = 0,
    bytes_received: int = 0,
    token_requests: int = 0,
    retries: int = 0,
) -> None:
    """Add to the client's totals and to every `track()` block active in this context."""
    for stats in (totals, *_active_stats.get()):
        stats.requests += requests
        stats.bytes_received += bytes_received
        stats.token_requests += token_requests
        stats.retries += retries


@contextlib.contextmanager
def track() -> Iterator[RequestStats]:
    """Count requests made in this context (and tasks started from it); nests and is task-safe."""
    stats = RequestStats()
    token = _active_stats.set((*_active_stats.get(), stats))
    try:
        yield stats
    finally:
        _active_stats.reset(token)
