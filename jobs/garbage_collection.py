"""When `gpubadge serve` collects garbage: the young generations on a timer on the event loop, the
old one on a slower timer, never by the interpreter's allocation count alone.

Why not the interpreter's own rule: CPython (3.11) starts a young collection when the tracked
objects allocated minus those freed pass a threshold, and every free counts, whatever generation
the object was in. A fleet's service frees old objects as fast as it makes new ones: each of
10,000 long polls renews every 30 s, and the poll that ends (its request, task and futures, long
since promoted to the old generation) is freed as the new one is allocated. The count then stays
near zero while the youngest generation grows to tens of thousands of objects, and when a
collection finally starts it walks them all with the interpreter lock held: 40-180 ms of CPU in
whichever thread allocated (often the store's), during which the loop answers nothing
(bench/fleet_bench.py with a diagnostic collector hook; bench/RESULTS.md).

So, once the service is up (`TimedCollection.start`):
- what it imported and built before serving is frozen out of the collector's reach (modules,
  schemas and settings live as long as the process);
- generation 0 is collected every `YOUNG_SECONDS` on the loop, and generations 0 and 1 every
  `MIDDLE_EVERY`-th time, so each collection walks only what a few milliseconds allocated
  (about 0.1-1 ms under the fleet's load); while collections find little to walk (each under
  `BUSY_COLLECTION_SECONDS`) the wait doubles up to `IDLE_SECONDS`, and the first busy one
  brings it back to `YOUNG_SECONDS` (`next_wait`). On a VM a timer's wake-up costs an idle
  process 35-390 us of CPU (bench.common.wakeup_cpu_seconds), so a fixed 10 ms timer was 100
  wake-ups and about 15 ms of CPU a second for nothing; the collector's own count cannot tell
  idle from busy (see above), the time a collection took can (a collection preempted midway
  looks busy: the rule errs towards collecting);
- the interpreter's own young threshold is raised to `BURST_THRESHOLD`, so it starts a collection
  only for a burst the timer would be late for (a thread parsing thousands of inventories);
- the old generation (a fleet's million objects: servers, the index, one held request per poll)
  is never walked as a matter of course. Under 10,000 agents a full collection walks about
  900,000 objects in 0.6-0.8 s, the loop stopped, and in steady state it found nothing to free
  (everything goes by reference counting): on a 5-minute timer, as before, it stalled every answer
  for most of a second for nothing, and started by memory growth (a quarter, `FULL_GROWTH`,
  looked at every `FULL_CHECK_SECONDS`) it still came once, about a minute after a fleet's 10,000
  polls opened (a 668 ms stall, jobs/event_loop.py's monitor named it). Now that growth collects
  the young and middle generations and then freezes what survived (`gc.freeze`: the objects leave
  the collector's reach, in one step that walks nothing). The trade: garbage in reference cycles
  that reached the old generation before a step is kept until the process restarts (the young
  timer collects cycles while they are young; a full pass under the fleet found nothing to free),
  and memory kept for that reason shows in `gpubadge_gc_frozen_objects` and the resident memory.
  A backstop that walked everything once memory doubled was tried: it fired on the fleet's own
  growth (an 823 ms stall inside an eligibility window), so no full pass runs while serving.
"""

from __future__ import annotations

import asyncio
import gc
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

YOUNG_SECONDS = 0.01
IDLE_SECONDS = 0.16  # the longest wait between young collections, reached while they find little
BUSY_COLLECTION_SECONDS = 50e-6  # about 2,500 young objects walked: the wait goes back to 10 ms
MIDDLE_EVERY = 3  # every third young collection takes generation 1 too
BURST_THRESHOLD = 5000
FULL_CHECK_SECONDS = 60.0
FULL_GROWTH = 1.25  # the interpreter's own rule for the old generation allows it 25% growth too

Collect = Callable[[int], Any]


def generation_at(tick: int) -> int:
    """The oldest generation the `tick`-th timed young collection takes (counting from 1)."""
    return 1 if tick % MIDDLE_EVERY == 0 else 0


def next_wait(
    wait: float, spent: float, shortest: float = YOUNG_SECONDS, longest: float = IDLE_SECONDS
) -> float:
    """The wait before the next young collection, after one that took `spent` seconds: `shortest`
    after a busy one, else twice `wait`, up to `longest`."""
    return shortest if spent >= BUSY_COLLECTION_SECONDS else min(longest, wait * 2)


async def collect_young(
    period: float = YOUNG_SECONDS,
    collect: Collect = gc.collect,
    longest: float = IDLE_SECONDS,
    clock: Callable[[], float] = time.perf_counter,
) -> None:
    """Forever: `collect(generation_at(tick))`, `period` seconds apart while collections are busy,
    up to `longest` apart while they are not (`next_wait`)."""
    tick = 0
    wait = period
    while True:
        await asyncio.sleep(wait)
        tick += 1
        started = clock()
        collect(generation_at(tick))
        wait = next_wait(wait, clock() - started, period, longest)


def resident_bytes() -> int:
    """This process's resident memory now (Linux: /proc/self/statm, a read of kernel memory that
    never blocks); elsewhere its peak so far, which grows when the resident memory does."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


async def collect_old(
    period: float = FULL_CHECK_SECONDS,
    growth: float = FULL_GROWTH,
    memory: Callable[[], int] = resident_bytes,
    collect: Collect = gc.collect,
    freeze: Callable[[], None] = gc.freeze,
) -> None:
    """Forever: every `period` seconds, once `memory()` has grown by `growth` since the last look
    that acted (or since this started), collect generations 0 and 1 and freeze what survived."""
    baseline = memory()
    while True:
        await asyncio.sleep(period)
        if memory() >= baseline * growth:
            collect(1)
            freeze()
            baseline = memory()


class TimedCollection:
    """This process's garbage collected on the timers above, from `start` until `stop` (the serve
    process only, which owns its interpreter: `gpubadge serve` starts it with its application;
    tests and embedders keep the interpreter's own rule)."""

    def __init__(self) -> None:
        self.timers: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Freeze what exists now, raise the young threshold, and start both timers on this loop."""
        gc.freeze()
        _, middle, _ = gc.get_threshold()
        gc.set_threshold(BURST_THRESHOLD, middle, 1_000_000_000)
        loop = asyncio.get_running_loop()
        self.timers = [loop.create_task(collect_young()), loop.create_task(collect_old())]

    async def stop(self) -> None:
        for task in self.timers:
            task.cancel()
        await asyncio.gather(*self.timers, return_exceptions=True)
