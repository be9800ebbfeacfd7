"""The CPU architectures of the known servers, which the scanner adds to the platforms it reads.

By default the scanner reads the layers of linux/amd64 and linux/arm64, plus every architecture a
known server reports (`scanner.facts.platforms`). Servers are the inventory file's and the agents'
(stored by the store, so a `gpubadge worker` process sees the agents the API replicas registered).
The store is read at most every `refresh_seconds`; inventories are parsed off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable, Sequence

from placement.inventory import Server
from store import queries
from store.facade import AsyncStore

REFRESH_SECONDS = 30.0


def _architectures(documents: Sequence[str]) -> set[str]:
    found: set[str] = set()
    for document in documents:
        try:
            arch = json.loads(document).get("arch")
        except (ValueError, AttributeError):
            continue
        if isinstance(arch, str) and arch:
            found.add(Server(name="-", arch=arch).arch)  # the inventory's own aliases (x86_64 -> amd64)
    return found


class FleetArchitectures:
    """Awaitable provider of the fleet's architectures (see the module docstring)."""

    def __init__(
        self, store: AsyncStore, static: Iterable[Server] = (), refresh_seconds: float = REFRESH_SECONDS
    ) -> None:
        self.store = store
        self.static = frozenset(server.arch for server in static)
        self.refresh_seconds = refresh_seconds
        self._known: frozenset[str] = self.static
        self._read_at: float | None = None
        self._lock = asyncio.Lock()

    async def __call__(self) -> frozenset[str]:
        async with self._lock:
            now = time.monotonic()
            if self._read_at is None or now - self._read_at >= self.refresh_seconds:
                records = await self.store.run(queries.servers)
                agents = await asyncio.to_thread(_architectures, [row.inventory_json for row in records])
                self._known, self._read_at = self.static | agents, now
            return self._known
