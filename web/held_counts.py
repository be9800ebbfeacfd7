"""`HeldCounts`: how many of something (connections, long polls) each key holds, and in all.

The connection guard counts connections per peer address, the public long polls per peer, the
agents' long polls per server: each admits against the total and a key's own count, and gives
one back when it ends. A key that holds none is dropped, so peers that have gone cost no memory.
On one event loop; not thread-safe.
"""

from __future__ import annotations


class HeldCounts:
    def __init__(self) -> None:
        self.total = 0
        self._by_key: dict[str, int] = {}

    def of(self, key: str) -> int:
        return self._by_key.get(key, 0)

    def take(self, key: str) -> None:
        self.total += 1
        self._by_key[key] = self._by_key.get(key, 0) + 1

    def give_back(self, key: str) -> None:
        self.total -= 1
        left = self._by_key.get(key, 0) - 1
        if left > 0:
            self._by_key[key] = left
        else:
            self._by_key.pop(key, None)
