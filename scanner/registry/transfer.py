"""The slowest transfer a registry may hold a scan with: GPUBADGE_MIN_TRANSFER_RATE over a window.

A throttled proxy that drips a manifest or a blob one byte a second never trips a per-read
timeout, so without a floor on the rate it holds a worker for the whole scan budget. The
guard is judged over the time spent waiting for the network only (a consumer that pauses to
analyse what it read is not the registry's fault), in consecutive windows of
`min_transfer_window` seconds: a window that brought fewer than `min_transfer_rate` bytes a
second ends the transfer with `SlowTransfer`, whose message names the setting and the host.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from scanner.registry.errors import SlowTransfer

# At a request's own timeout, a body that was read this long below the rate counts as cut off.
TIMEOUT_JUDGED_AFTER = 1.0


class TransferGuard:
    """Counts one transfer's bytes against its waiting time; `received` raises when too slow."""

    def __init__(
        self,
        rate: int,
        window: float,
        *,
        what: str,
        host: str,
        on_cutoff: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate, self.window = rate, window
        self.what, self.host = what, host
        self.clock = clock
        self._on_cutoff = on_cutoff
        self._window_waited = 0.0
        self._window_bytes = 0
        self.waited = 0.0
        self.bytes = 0

    def received(self, since: float, amount: int) -> None:
        """A read that began at `since` (a `clock()` value) brought `amount` bytes."""
        if self.rate <= 0:
            return
        waited = max(0.0, self.clock() - since)
        self.waited += waited
        self.bytes += amount
        self._window_waited += waited
        self._window_bytes += amount
        if self._window_waited >= self.window:
            if self._window_bytes < self.rate * self._window_waited:
                raise self.cut_off(self._window_bytes, self._window_waited)
            self._window_waited, self._window_bytes = 0.0, 0

    def timed_out(self) -> SlowTransfer | None:
        """At the request's own timeout: the cut-off to raise instead, when the body was too slow."""
        if self.rate <= 0 or self.waited < TIMEOUT_JUDGED_AFTER or self.bytes >= self.rate * self.waited:
            return None
        return self.cut_off(self.bytes, self.waited)

    def cut_off(self, amount: int, seconds: float) -> SlowTransfer:
        if self._on_cutoff is not None:
            self._on_cutoff()
        return SlowTransfer(
            f"{self.what}: cut off, {self.host} sent {amount} bytes in {seconds:.0f} s, slower than"
            f" GPUBADGE_MIN_TRANSFER_RATE ({self.rate} bytes/s over GPUBADGE_MIN_TRANSFER_WINDOW"
            f" {self.window:g} s); the scan is retried later",
            host=self.host,
        )
