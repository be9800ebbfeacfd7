"""Group commit for incoming scan jobs, on a commit thread of the intake's own.

Each delivery must be durable before its 202, but one SQLite commit per request
caps the intake rate and lengthens the queue behind it. Deliveries are instead
committed in groups: the first delivery hands a commit to the intake's thread at
once, and everything that arrives while that commit (and its fsync, with
synchronous=FULL) is in flight joins the next one. The event loop keeps accepting
requests the whole time, and each caller still answers only after its own commit.

The registry waits for each answer before it sends its next delivery, so the hop to
the commit thread is the cheapest there is: one queue put to wake the thread, one
`call_soon_threadsafe` to come back, and the callers' futures settled directly on the
loop, with no executor future, no chained callbacks and no task per group.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Sequence

from store import AsyncStore, EnqueueBatch

Pending = list[tuple[EnqueueBatch, asyncio.Future[list[str]]]]
Outcome = list[list[str]] | BaseException


class JobIntake:
    def __init__(self, store: AsyncStore) -> None:
        self.store = store
        self._pending: Pending = []
        self._committing = False
        self._groups: queue.SimpleQueue[tuple[asyncio.AbstractEventLoop, Pending] | None] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # starts the thread once, whichever loop asks first

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
            self._dispatch(loop)
        return await future

    async def close(self) -> None:
        """Let the commits handed over finish, then stop the commit thread (before the store closes)."""
        thread = self._thread
        if thread is not None:
            self._groups.put(None)
            await asyncio.get_running_loop().run_in_executor(None, thread.join)
            self._thread = None

    def _dispatch(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the loop: hand every pending delivery to the commit thread as one group."""
        group, self._pending = self._pending, []
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._commit_groups, name="intake", daemon=True)
                    self._thread.start()
        self._groups.put((loop, group))

    def _commit_groups(self) -> None:
        """The commit thread: one transaction per group, then back to the loop with the outcome."""
        while (item := self._groups.get()) is not None:
            loop, group = item
            outcome: Outcome
            try:
                outcome = self.store.backend.enqueue_many([batch for batch, _ in group])
            except Exception as exc:  # every delivery of the group learns its commit failed
                outcome = exc
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for these answers
                loop.call_soon_threadsafe(self._settle, loop, group, outcome)

    def _settle(self, loop: asyncio.AbstractEventLoop, group: Pending, outcome: Outcome) -> None:
        """On the loop: answer each delivery of the group, then start the next group, if any."""
        if isinstance(outcome, BaseException):
            for _, future in group:
                if not future.done():
                    future.set_exception(outcome)
        else:
            for (_, future), ids in zip(group, outcome, strict=True):
                if not future.done():
                    future.set_result(ids)
            self.store.jobs_queued()
        if self._pending:
            self._dispatch(loop)
        else:
            self._committing = False
