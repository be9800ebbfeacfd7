"""Group commit for incoming scan jobs.

Each delivery must be durable before its 202, but one SQLite commit per request
caps the intake rate and lengthens the queue behind it. Deliveries are instead
committed in groups: the first delivery starts a commit in a worker thread, and
everything that arrives while that commit (and its fsync, with synchronous=FULL)
is in flight joins the next one. The event loop keeps accepting requests the
whole time, and each caller still answers only after its own commit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from store import AsyncStore, EnqueueBatch

Pending = list[tuple[EnqueueBatch, asyncio.Future[list[str]]]]


class JobIntake:
    def __init__(self, store: AsyncStore) -> None:
        self.store = store
        self._pending: Pending = []
        self._committing = False
        self._task: asyncio.Task[None] | None = None  # held so the running commit is not collected

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
        self._pending.append((EnqueueBatch(references, source, max_attempts), future))
        if not self._committing:
            self._committing = True
            loop.call_soon(self._next_group)  # deliveries read in this same loop turn join in
        return await future

    def _next_group(self) -> None:
        group, self._pending = self._pending, []
        self._task = asyncio.get_running_loop().create_task(self._commit(group))

    async def _commit(self, group: Pending) -> None:
        try:
            results = await self.store.enqueue_many([batch for batch, _ in group])
        except Exception as exc:  # every delivery of the group learns its commit failed
            for _, future in group:
                if not future.done():
                    future.set_exception(exc)
        else:
            for (_, future), ids in zip(group, results, strict=True):
                if not future.done():
                    future.set_result(ids)
        finally:
            if self._pending:
                self._next_group()
            else:
                self._committing = False
