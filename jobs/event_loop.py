"""The event loop every gpubadge process runs (`new_event_loop`), and a monitor of what holds it up.

`new_event_loop` is uvloop's loop where it is installed (`pip install gpubadge[uvloop]`), else
asyncio's: a registry waits for each webhook answer before it sends the next delivery, so the
loop's own cost per request (scheduling, polling, socket writes) is paid once per push along the
queue, and a scan's (HTTP to the registry, pipes to the analysis processes) once per image;
uvloop's is about a fifth of a delivery's CPU lower (bench/webhook_cpu_bench.py).

`LoopLagMonitor` (`serve` runs one) says what holds the loop up.

Every request `serve` answers waits for its one event loop; a callback that runs long (a young
collection, a fleet's stamps compared, a decision made on the loop) or a thread that keeps the
interpreter lock holds every answer up by as long. The monitor measures that lag where it
happens: a timer on the loop is due every `TICK_SECONDS`, and how late it fires is the loop's
lag, counted in `gpubadge_event_loop_lag_seconds` (a histogram). A watchdog thread sleeps until
the next tick is overdue; when the loop has not ticked for `stall_seconds`
(GPUBADGE_LOOP_STALL_SECONDS) it takes, once per stall, the loop thread's stack and where every
other thread is, and the stall is logged with them when the loop comes back, with how long it
lasted and how much of that the loop's thread spent waiting for a core (`/proc`'s schedstat: a
host too busy to run the service is told apart from the service blocking itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

log = logging.getLogger(__name__)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed, else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


TICK_SECONDS = 0.05  # the loop's timer: its lateness is the lag (20 wake-ups a second)
STACK_DEPTH = 12  # frames of the loop thread's stack kept for the log


class LoopLagMonitor:
    """`await start()` on the loop to watch; `stop()` to end. `observe(seconds)` gets each tick's lag."""

    def __init__(self, stall_seconds: float, observe: Callable[[float], None] | None = None) -> None:
        self.stall_seconds = stall_seconds
        self._observe = observe
        self._last_tick = time.monotonic()
        self._task: asyncio.Task[None] | None = None
        self._watchdog: threading.Thread | None = None
        self._stopping = threading.Event()
        self._loop_thread = threading.get_ident()
        self._stall_stack: list[str] | None = None  # taken by the watchdog during the current stall
        self.stalls = 0

    async def start(self) -> None:
        """Start watching the running loop (its timer task and the watchdog thread)."""
        self._loop_thread = threading.get_ident()
        self._last_tick = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._tick(), name="loop-lag")
        if self.stall_seconds > 0:
            self._watchdog = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)
            self._watchdog.start()

    async def stop(self) -> None:
        self._stopping.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._watchdog is not None:
            self._watchdog.join(timeout=1.0)

    async def _tick(self) -> None:
        run_queue = RunQueueWait(f"/proc/self/task/{threading.get_native_id()}/schedstat")
        try:
            await self._keep_time(run_queue)
        finally:
            run_queue.close()

    async def _keep_time(self, run_queue: RunQueueWait) -> None:
        waited = run_queue.seconds()
        while True:
            due = time.monotonic() + TICK_SECONDS
            await asyncio.sleep(TICK_SECONDS)
            now = time.monotonic()
            lag = max(0.0, now - due)
            self._last_tick = now
            if self._observe is not None:
                self._observe(lag)
            before, waited = waited, run_queue.seconds()
            stack, self._stall_stack = self._stall_stack, None
            if stack is None:
                continue
            self.stalls += 1
            log.warning(
                "the event loop stalled for %.0f ms (%.0f ms of it waiting for a core); its thread was in:\n%s",
                lag * 1000,
                max(0.0, waited - before) * 1000,
                "".join(stack).rstrip(),
            )

    def _watch(self) -> None:
        """The watchdog thread: once per stall, the loop thread's stack and where the others are.

        It sleeps until the loop's next tick is `stall_seconds` overdue, so a loop that keeps time
        wakes it a few times a second (polling every few milliseconds cost an idle `serve` 11 ms of
        CPU a second); during a stall it looks again each tick's length until the loop is back."""
        while True:
            overdue_in = self._last_tick + TICK_SECONDS + self.stall_seconds - time.monotonic()
            if overdue_in > 0:
                if self._stopping.wait(overdue_in):
                    return
                continue
            if self._stall_stack is None:
                self._stall_stack = self._stacks()
            if self._stopping.wait(TICK_SECONDS):
                return

    def _stacks(self) -> list[str] | None:
        """The loop thread's stack and one line for each other thread; None if it is gone."""
        frames = sys._current_frames()
        frame = frames.get(self._loop_thread)
        if frame is None:
            return None
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        others = [
            f"  thread {names.get(ident, ident)}: {other.f_code.co_name}"
            f" ({other.f_code.co_filename.rpartition('/')[2]}:{other.f_lineno})\n"
            for ident, other in frames.items()
            if ident not in (self._loop_thread, threading.get_ident())
        ]
        return [*traceback.format_stack(frame, limit=STACK_DEPTH), "other threads:\n", *others]


class RunQueueWait:
    """Seconds a thread has waited in a run queue for a core so far, from its /proc schedstat
    file, held open and read again in place each tick (a `pread`, 0.5 us; opening it each time
    was 10 us); 0 where /proc does not say."""

    def __init__(self, schedstat: str) -> None:
        try:
            self._fd: int | None = os.open(schedstat, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = None

    def seconds(self) -> float:
        if self._fd is None:
            return 0.0
        try:
            return int(os.pread(self._fd, 128, 0).split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            return 0.0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
