"""When and how long to wait before asking a registry again. Pure but for the sleep.

What may pass on a second try is retried with exponential backoff and jitter: 5xx and 408,
connection resets, timeouts, and 429. A 429's (or 503's) Retry-After is honoured up to
`retry_after_max`; a longer one is raised at once, so the caller can put the work back
instead of holding a worker asleep. With `defer_retry_after` (the service's workers) every
Retry-After is raised at once: the job goes back to the queue with `not_before` and the
registry's gate closes, instead of a worker sleeping on it. A transfer cut off for being too
slow (`SlowTransfer`) is never retried here either: the job queue retries it with its backoff.
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp

from scanner.registry.errors import RateLimited, RegistryError, SlowTransfer, transport_error
from scanner.registry.stats import RequestStats, count
from scanner.settings import ScannerSettings

T = TypeVar("T")

RETRYABLE_STATUSES = frozenset({408, 500, 502, 503, 504, 522})


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    current = time.time() if now is None else now
    return max(0.0, when.timestamp() - current)


def parse_rate_limit(value: str | None) -> int | None:
    """`100;w=21600` -> 100."""
    if not value:
        return None
    head = value.split(";", 1)[0].strip()
    return int(head) if head.isdigit() else None


class RetryPolicy:
    """Runs one registry operation with the retries `settings` allow; counts each retry in `totals`."""

    def __init__(
        self,
        settings: ScannerSettings,
        totals: RequestStats,
        *,
        defer_retry_after: bool = False,
        on_retry_after: Callable[[str, float], None] | None = None,
    ) -> None:
        self.settings = settings
        self.totals = totals
        self.defer_retry_after = defer_retry_after
        self.on_retry_after = on_retry_after  # (host, seconds): a registry asked us to wait

    def backoff(self, attempt: int) -> float:
        delay = min(self.settings.backoff_max, self.settings.backoff_base * (2.0**attempt))
        return delay * random.uniform(0.5, 1.0)

    async def run(self, operation: Callable[[], Awaitable[T]], host: str | None = None) -> T:
        """Run `operation`, retrying what may pass (5xx, resets, timeouts, 429) with backoff."""
        attempts = max(1, self.settings.retries)
        for attempt in range(attempts):
            try:
                return await operation()
            except (aiohttp.ClientError, TimeoutError) as exc:
                error = transport_error(exc, self.settings.request_timeout, host=host)
                if not error.retryable or attempt == attempts - 1:
                    raise error from None
                delay = self.backoff(attempt)
            except RegistryError as exc:
                waited = exc.retry_after if isinstance(exc, RateLimited) else None
                if waited is not None and host is not None and self.on_retry_after is not None:
                    self.on_retry_after(host, waited)
                if not exc.retryable or attempt == attempts - 1 or isinstance(exc, SlowTransfer):
                    raise
                delay = self.backoff(attempt)
                if isinstance(exc, RateLimited) and exc.retry_after is not None:
                    if self.defer_retry_after or exc.retry_after > self.settings.retry_after_max:
                        raise
                    delay = exc.retry_after
            count(self.totals, retries=1)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable: retry loop ended")
