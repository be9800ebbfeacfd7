"""Queue events: a settle wakes the waiters on its job or reference, not every waiter."""

from __future__ import annotations

import asyncio

import pytest

from store import events
from store.events import SETTLED, QueueEvents


async def test_keyed_waiters_wake_on_their_job_or_reference_only(monkeypatch: pytest.MonkeyPatch) -> None:
    queue = QueueEvents()
    queue.cross_process = True  # as with a PostgreSQL listener: no periodic re-check in reach
    monkeypatch.setattr(events, "SAFETY_RECHECK", 600.0)
    checks: dict[str, int] = {"job": 0, "ref": 0, "other": 0}
    done: dict[str, bool] = {"job": False, "ref": False, "other": False}

    def waiter(name: str, key: str) -> asyncio.Task[bool]:
        async def condition() -> bool:
            checks[name] += 1
            return done[name]

        return asyncio.create_task(queue.wait_until(condition, timeout=30, key=key))

    tasks = {
        "job": waiter("job", "j1"),
        "ref": waiter("ref", "r.example/app:1"),
        "other": waiter("other", "r.example/other:1"),
    }
    await asyncio.sleep(0)  # every waiter has looked once
    assert checks == {"job": 1, "ref": 1, "other": 1}
    done["job"] = done["ref"] = True
    # a webhook job's key carries the digest; a tag waiter still matches it
    queue.fire(SETTLED, "j1 r.example/app:1@sha256:" + "0" * 64)
    assert await asyncio.wait_for(tasks["job"], 5) and await asyncio.wait_for(tasks["ref"], 5)
    assert checks["other"] == 1  # not woken by a settle of something else
    done["other"] = True
    queue.fire(SETTLED)  # a settle without a payload (a local write on SQLite) wakes everyone
    assert await asyncio.wait_for(tasks["other"], 5)
    assert checks == {"job": 2, "ref": 2, "other": 2}
    assert not queue._keyed  # nothing left behind


async def test_a_wait_cancelled_as_its_event_fires_ends_cancelled() -> None:
    """A cancel that comes in the same loop turn as the wake-up is not lost: Python 3.11's
    `asyncio.wait_for` returned the wake-up and dropped the cancel, so the replica follower's
    `while True` went on and the service's shutdown waited for it forever (seen once in CI)."""
    from web.fleet.live_fleet import FleetIndexCache

    queue = QueueEvents()

    async def never() -> bool:
        return False

    cache = FleetIndexCache()
    waits = {
        "a settle waiter": (asyncio.create_task(queue.wait_until(never, 30.0)), lambda: queue.fire(SETTLED)),
        "the replica follower": (asyncio.create_task(cache.follow_due(30.0)), cache.stamps_written_elsewhere),
    }
    await asyncio.sleep(0)  # each is waiting now
    for what, (task, wake) in waits.items():
        wake()
        task.cancel()  # in the same turn of the loop as the wake-up
        done, _ = await asyncio.wait({task}, timeout=5)
        assert done and task.cancelled(), f"{what} went on waiting after its cancel"


async def test_the_replica_follower_waits_on_a_timer_only_once_another_process_writes_stamps() -> None:
    """Alone (one `serve` on a SQLite file), a timed round would read this process's own stamps
    back: 10,000 rows every round under a fleet. Once another process has written stamps, a timed
    round catches up a notification lost with the listener's connection."""
    from web.fleet.live_fleet import FleetIndexCache

    cache = FleetIndexCache()
    alone = asyncio.create_task(cache.follow_due(0.01))
    finished, _ = await asyncio.wait({alone}, timeout=0.3)  # thirty timeouts' worth
    assert not finished, "the follower woke on its timer with no other process writing stamps"
    cache.stamps_written_elsewhere()
    await asyncio.wait_for(alone, 5)
    timed = asyncio.create_task(cache.follow_due(0.01))  # no notification this time
    finished, _ = await asyncio.wait({timed}, timeout=5)
    assert finished, "with another process writing stamps, the timed round never came"
