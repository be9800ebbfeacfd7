"""The live fleet across API replicas on one real PostgreSQL: what each replica learns from the
others' heartbeats, and that learning it never holds up a request.

Two services run in this process on one database, as two `serve` replicas would (the benchmark,
bench/fleet_bench.py --postgres, runs them as processes with 10,000 agents). Every wait is
bounded and ends on what it waits for.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import psycopg
import pytest
from aiohttp import web

from bench.placement_bench import REFERENCE, REGISTRY, REPOSITORY, TAG, gpu_report
from fixtures.registry import free_port
from store import queries
from store.postgres import PostgresStore
from web.app import create_app
from web.fleet.live_fleet import FLEET_INDEX
from web.settings import ServiceSettings

HEARTBEAT, STALE, FLUSH = 1.0, 3.0, 0.2
CHECK_SECONDS = (
    1.0  # FleetIndexCache's timed check; the replicas read each other's stamps as often (FLUSH is below it)
)


class Replica:
    """One API process's service, on a port of its own."""

    def __init__(self, url: str, app: web.Application) -> None:
        self.url = url
        self.app = app

    async def eligible(self, session: aiohttp.ClientSession, timeout: float = 10.0) -> list[str]:
        body = {"image": REFERENCE, "gpus": 1, "limit": 10}
        async with session.post(
            self.url + "/api/eligibility", json=body, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as response:
            answer = await response.json()
            assert response.status == 200, answer
        return sorted(item["server"] for item in answer["eligible"])


@pytest.fixture
async def replicas(postgres_url: str) -> AsyncIterator[list[Replica]]:
    store = PostgresStore(postgres_url, pool_size=2)
    report = gpu_report()
    store.run(queries.save_report, report)
    store.run(queries.record_tag, REGISTRY, REPOSITORY, TAG, report.digest or "")
    store.close()
    async with AsyncExitStack() as stack:
        started = []
        for _ in range(2):
            settings = ServiceSettings(
                database_url=postgres_url,
                port=0,
                docker_config=None,
                heartbeat_seconds=HEARTBEAT,
                stale_after_seconds=STALE,
                heartbeat_flush_seconds=FLUSH,
                allow_agents_without_token=True,  # the agents here present no token
            )
            app = create_app(settings, start_workers=False)
            runner = web.AppRunner(app)
            await runner.setup()
            stack.push_async_callback(runner.cleanup)
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            started.append(Replica(f"http://127.0.0.1:{port}", app))
        yield started


def _server(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "cpus": 64,
        "memory": 512 * 1024**3,
        "driver_version": "535.104.05",
        "cuda_driver_version": "12.2",
        "gpus": [
            {
                "index": 0,
                "uuid": f"GPU-{name}-0",
                "name": "NVIDIA H100 80GB HBM3",
                "brand": "Nvidia",
                "memory_mib": 81559,
                "compute_capability": "9.0",
            }
        ],
    }


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
    async with session.post(url, json=body) as response:
        assert response.status == 200, await response.text()


async def _until(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> float:
    """Seconds until `check()` holds; fails the test past `timeout`."""
    started = time.monotonic()
    while not await check():
        assert time.monotonic() - started < timeout, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


async def test_an_agent_heard_by_one_replica_is_live_dead_and_back_on_the_other(
    replicas: list[Replica],
) -> None:
    heard_by, other = replicas
    async with aiohttp.ClientSession() as session:
        await _post(session, heard_by.url + "/api/servers", _server("solo"))
        assert await other.eligible(session) == ["solo"]  # registered through the first: read from the store

        async def beat() -> None:
            await _post(session, heard_by.url + "/api/servers/solo/heartbeat", {})

        async def other_sees(expected: list[str]) -> bool:
            return await other.eligible(session) == expected

        # beating through the first replica only, it stays live on the other past STALE
        deadline = time.monotonic() + STALE + 2 * HEARTBEAT
        while time.monotonic() < deadline:
            await beat()
            assert await other.eligible(session) == ["solo"]
            await asyncio.sleep(HEARTBEAT / 2)
        # silent, it leaves both within STALE plus one check
        silent_at = time.monotonic()
        await _until(lambda: other_sees([]), STALE + CHECK_SECONDS + 2.0, "the other replica drops it")
        assert time.monotonic() - silent_at >= STALE - 2 * HEARTBEAT  # not before it went silent
        assert await heard_by.eligible(session) == []
        # heard again through the first replica, it is back on the other within a flush and a read
        await beat()
        back = await _until(
            lambda: other_sees(["solo"]), FLUSH + 2 * CHECK_SECONDS + 2.0, "back on the other"
        )
        assert back <= FLUSH + 2 * CHECK_SECONDS + 2.0


async def test_eligibility_never_waits_for_the_read_of_other_replicas_heartbeats(
    replicas: list[Replica], postgres_url: str
) -> None:
    """The replicas' stamps are read in a task of their own: with that read stuck behind a lock on
    the server table, eligibility still answers at once from memory (it used to run the read
    itself, once a second, in whichever request came along)."""
    replica = replicas[0]
    async with aiohttp.ClientSession() as session:
        await _post(session, replica.url + "/api/servers", _server("solo"))
        assert await replica.eligible(session) == ["solo"]  # the first query reads the fleet
        # the other replica's stamps: from then on this one reads on its timer too, not only when told
        await _post(session, replicas[1].url + "/api/servers/solo/heartbeat", {})

        async def told_of_other_stamps() -> bool:
            return replica.app[FLEET_INDEX].stamps_elsewhere

        await _until(told_of_other_stamps, FLUSH + 5.0, "the other replica's stamps heard of")
        with psycopg.connect(postgres_url) as locker:
            # held until the block ends: the server table and the stamps' own table
            locker.execute("LOCK TABLE servers, server_heartbeats IN ACCESS EXCLUSIVE MODE")

            def stamps_read_waiting() -> bool:
                with psycopg.connect(postgres_url, autocommit=True) as watcher:
                    row = watcher.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        " AND (query LIKE 'SELECT %FROM servers%' OR query LIKE 'SELECT %FROM server_heartbeats%')"
                    ).fetchone()
                return bool(row and row[0])

            async def stamps_read_blocked() -> bool:
                return await asyncio.to_thread(stamps_read_waiting)

            # the server table (re-read after the registration's NOTIFY) or the stamps since the last read
            await _until(stamps_read_blocked, 10.0, "the replica reads what the others wrote on its own")
            for _ in range(3):  # each past a timed check; the agent beats (a stamp in memory)
                await _post(session, replica.url + "/api/servers/solo/heartbeat", {})
                started = time.monotonic()
                assert await replica.eligible(session, timeout=5.0) == ["solo"]
                assert time.monotonic() - started < 2.0
                await asyncio.sleep(CHECK_SECONDS)
            locker.rollback()
        await _post(session, replica.url + "/api/servers/solo/heartbeat", {})
        assert await replica.eligible(session) == ["solo"]
