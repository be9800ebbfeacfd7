"""Group commit for incoming scan jobs.

Each delivery must be durable before its 202, but one SQLite commit per request
caps the intake rate and lengthens the queue behind it. Deliveries that arrive
in the same event-loop turn are committed together in one transaction, and each
caller still waits for that commit before answering.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from scanner.store import EnqueueBatch, Store


class JobIntake:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._pending: list[tuple[EnqueueBatch, asyncio.Future[list[str]]]] = []

    async def enqueue(
        self,
        references: Sequence[tuple[str, str] | tuple[str, str, float]],
        *,
        source: str | None,
        max_attempts: int,
    ) -> list[str]:
        """Queue one delivery's jobs; returns once they are committed, with their ids."""
        if not references:
            return []
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[str]] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append((EnqueueBatch(references, source, max_attempts), future))
        return await future

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        try:
            results = self.store.enqueue_many([batch for batch, _ in pending])
        except Exception as exc:  # every waiting delivery learns the commit failed
            for _, future in pending:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, future), ids in zip(pending, results, strict=True):
            if not future.done():
                future.set_result(ids)
