"""The loop-lag monitor `serve` runs (jobs/event_loop.py): every lag counted, a stall named by the
code that held the loop (issue 44, point 7: find what blocks the loop, don't guess)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from jobs.event_loop import TICK_SECONDS, LoopLagMonitor


def hold_the_loop_in_a_named_function(seconds: float) -> None:
    time.sleep(seconds)  # what a synchronous call on the loop does to every request meanwhile


async def test_a_stall_is_logged_with_the_code_that_held_the_loop(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="jobs.event_loop")
    lags: list[float] = []
    monitor = LoopLagMonitor(stall_seconds=0.05, observe=lags.append)
    await monitor.start()
    try:
        await asyncio.sleep(3 * TICK_SECONDS)
        assert monitor.stalls == 0 and max(lags) < 0.05  # an idle loop is on time
        hold_the_loop_in_a_named_function(0.2)
        deadline = time.monotonic() + 5
        while monitor.stalls == 0:
            assert time.monotonic() < deadline, "the stall was not reported"
            await asyncio.sleep(TICK_SECONDS)
    finally:
        await monitor.stop()
    assert max(lags) >= 0.15  # the tick after the stall was that late
    (record,) = [record for record in caplog.records if "stalled" in record.getMessage()]
    message = record.getMessage()
    assert "hold_the_loop_in_a_named_function" in message, message  # the loop thread's stack, named
    assert "waiting for a core" in message and "other threads:" in message


async def test_no_stall_is_logged_with_stall_logging_off(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="jobs.event_loop")
    lags: list[float] = []
    monitor = LoopLagMonitor(stall_seconds=0, observe=lags.append)
    await monitor.start()
    try:
        await asyncio.sleep(2 * TICK_SECONDS)
        hold_the_loop_in_a_named_function(0.1)
        await asyncio.sleep(3 * TICK_SECONDS)
    finally:
        await monitor.stop()
    assert max(lags) >= 0.05  # still measured and counted
    assert not [record for record in caplog.records if "stalled" in record.getMessage()]


async def test_the_watchdog_sleeps_while_the_loop_keeps_time() -> None:
    """The watchdog wakes once per `TICK_SECONDS + stall_seconds` of a punctual loop, not every few
    milliseconds: an idle `serve` paid 11 ms of CPU a second for 200 wake-ups of it."""
    import threading

    monitor = LoopLagMonitor(stall_seconds=0.1)
    await monitor.start()
    try:
        [watchdog] = [thread for thread in threading.enumerate() if thread.name == "loop-watchdog"]

        def wakeups() -> int:
            status = Path(f"/proc/self/task/{watchdog.native_id}/status").read_text()
            return int(status.split("voluntary_ctxt_switches:")[1].split()[0])

        before = wakeups()
        await asyncio.sleep(1.0)
        woke = wakeups() - before
    finally:
        await monitor.stop()
    assert woke <= 20, woke  # about 8 a second; polling every 5 ms was 200
