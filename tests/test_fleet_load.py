"""A live fleet in CI's time: 500 simulated agents against a real `gpubadge serve` (bench/fleet_bench.py).

The same run as the 10,000-agent benchmark, shortened: agents register, beat every 1.5 s and
hold long polls over real HTTP, through the agent's own client. Every wait in it is bounded and
ends on what it waits for (an agent holding its poll, a deployment in an agent's hands, the
eligible count); only the measuring windows are timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from agent.service_client import Backoff
from bench import fleet_bench
from fixtures.registry import free_port
from fixtures.service import held_wait
from web.app import create_app
from web.fleet.long_polls import LONG_POLLS, idle_poll_end
from web.settings import ServiceSettings

AGENTS, HEARTBEAT, STALE = 500, 1.5, 6.0
CHECK_SECONDS = 1.0  # FleetIndexCache's timed check


@pytest.fixture(scope="module")
def figures() -> dict[str, object]:
    return fleet_bench.main(
        [
            f"--agents={AGENTS}",
            f"--heartbeat={HEARTBEAT}",
            f"--stale={STALE}",
            "--flush=0.5",
            "--poll-wait=5",
            "--window=2",
            "--rounds=1",
            "--settle=1",
            "--deployments=5",
            "--churn=0.1",
            "--storm-limit=60",
        ]
    )


def test_heartbeats_are_cheap_and_write_no_inventory(figures: dict[str, object]) -> None:
    assert figures["inventories_rewritten"] == 0
    # everything the service spent while the fleet beat, divided by the heartbeats. The 0.4 ms target
    # is the bench's, at 10,000 agents (0.22-0.28 ms, bench/RESULTS.md). This 500-agent run measured
    # 0.415 ms once, on a VM whose idle-thread wake-ups cost 120-190 us that hour (35-60 us an hour
    # earlier, when it stayed under 0.4). Rewriting inventories per heartbeat, what this guards, cost 1.1 ms,
    # against a poll renewal's 0.41 ms. On 2026-12-01 the same VM ran 2-3x slower for hours: a heartbeat
    # measured 0.25-0.58 ms and a renewal 0.54-1.26 ms. So the bound is 0.5 ms, or, on a host that slow,
    # what renewing a held poll (the cheapest request an agent makes) cost in the same run.
    per_heartbeat = float(str(figures["cpu_ms_per_heartbeat"]))
    assert per_heartbeat <= max(0.5, float(str(figures["cpu_ms_per_poll"]))), figures["lines"]
    assert float(str(figures["heartbeats_per_second"])) >= 0.8 * AGENTS / HEARTBEAT, figures["lines"]


# The service's RSS grows in allocator steps, and the first polls pay for code paths and arenas
# that every later poll shares: about 1 MiB here. Spread over 10,000 polls (the bench) that is
# nothing; over the suite's 500 it is 2 KiB a poll, so it is allowed for once, not per poll.
RSS_STEP = 1024 * 1024


def test_a_held_long_poll_costs_at_most_20_kb(figures: dict[str, object]) -> None:
    assert float(str(figures["bytes_per_poll"])) <= 20 * 1024 + RSS_STEP / AGENTS, figures["lines"]


def test_eligibility_keeps_its_pace_under_the_fleet(figures: dict[str, object]) -> None:
    """The median, side by side with no agent traffic; the p99s are in the bench's figures (this
    shared CI host's scheduling noise dominates a tail of a few hundred queries)."""
    assert figures["requests_sent_quiet"] == 0, figures["lines"]  # quiet: no agent request at all
    quiet, loaded = float(str(figures["quiet_p50"])), float(str(figures["loaded_p50"]))
    assert loaded <= 2 * quiet + 0.002, figures["lines"]


def test_deployments_reach_their_agent_within_a_second(figures: dict[str, object]) -> None:
    assert float(str(figures["deploy_max"])) < 1.0, figures["lines"]


def test_dead_agents_drop_out_on_time_and_come_back(figures: dict[str, object]) -> None:
    assert figures["flaps"] == 0, figures["lines"]
    dropped = figures["drop_after_last_beat"]
    assert dropped is not None and float(str(dropped)) <= STALE + CHECK_SECONDS + 0.5, figures["lines"]
    assert float(str(figures["return_seconds"])) <= HEARTBEAT, figures["lines"]


def test_the_fleet_reconnects_after_a_restart(figures: dict[str, object]) -> None:
    assert float(str(figures["storm_seconds"])) <= 60, figures["lines"]
    assert figures["storm_failures"] == 0, figures["lines"]
    assert figures["storm_p99"] is not None, figures["lines"]


# ------------------------------------------------------------------ the long-poll budget


@contextlib.asynccontextmanager
async def serving(settings: ServiceSettings) -> AsyncIterator[tuple[web.Application, str]]:
    """The service's app (no workers) on a free loopback port: (app, base URL)."""
    app = create_app(settings, start_workers=False)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield app, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_past_the_long_poll_budget_a_poll_is_told_when_to_retry(tmp_path: Path) -> None:
    settings = ServiceSettings(
        db=tmp_path / "polls.db", long_poll_max=1, allow_agents_without_token=True, docker_config=None
    )
    async with serving(settings) as (app, url), aiohttp.ClientSession() as session:
        for name in ("node-a", "node-b"):
            server = {"name": name, "gpus": []}
            async with session.post(f"{url}/api/servers", json=server) as response:
                assert response.status == 200
        wait = held_wait("node-a", at_least=10)
        held = asyncio.create_task(_poll(session, f"{url}/api/agents/node-a/deployments?wait={wait:g}"))
        polls = app[LONG_POLLS]
        for _ in range(500):  # bounded: until the first poll holds the only slot
            if polls.held == 1:
                break
            await asyncio.sleep(0.01)
        assert polls.held == 1
        async with session.get(f"{url}/api/agents/node-b/deployments?wait=30") as response:
            assert response.status == 503
            assert response.headers["Retry-After"] == "5"
            assert "GPUBADGE_LONG_POLL_MAX" in (await response.json())["error"]
        # a poll that does not wait holds no slot and is answered as ever
        async with session.get(f"{url}/api/agents/node-b/deployments?wait=0") as response:
            assert response.status == 200
        assert polls.refused == 1
        # node-a polls again (its first connection is gone, say): the old poll answers at once
        # and the new one takes its slot
        async with session.get(f"{url}/api/agents/node-a/deployments?wait=0.2") as response:
            assert response.status == 200
        assert await asyncio.wait_for(held, 10) == 200
        assert polls.held == 0


async def test_idle_polls_opened_together_end_at_their_own_phase(tmp_path: Path) -> None:
    """Agents that reconnected together (a restart) would otherwise renew their polls together for
    as long as they run: every `wait` seconds a burst in front of every other request. An idle
    poll ends at its server's own point of the cycle (`idle_poll_end`), spread over the cycle."""
    settings = ServiceSettings(db=tmp_path / "polls.db", allow_agents_without_token=True, docker_config=None)
    wait, count = 1.0, 12
    async with serving(settings) as (_, url), aiohttp.ClientSession() as session:
        for n in range(count):
            async with session.post(f"{url}/api/servers", json={"name": f"node-{n}", "gpus": []}) as response:
                assert response.status == 200

        async def held(name: str) -> tuple[float, float]:
            opened = time.time()
            assert await _poll(session, f"{url}/api/agents/{name}/deployments?wait={wait:g}") == 200
            return time.time() - opened, idle_poll_end(name, wait, opened) - opened

        ends = await asyncio.wait_for(asyncio.gather(*(held(f"node-{n}") for n in range(count))), 10)
    for waited, due in ends:  # each at its own point, within its wait
        assert 0 < due <= wait, ends
        # a phase point that fell while the request was on its way is the next cycle's on the
        # service's clock: the poll is then held one more `wait`
        late = due < 0.3 and due + wait - 0.02 <= waited <= due + wait + 0.3
        assert due - 0.02 <= waited <= due + 0.3 or late, ends
    assert max(w for w, _ in ends) - min(w for w, _ in ends) >= 0.3, ends  # spread, not one moment


def test_idle_poll_ends_spread_a_fleet_over_the_cycle() -> None:
    """10,000 polls opened at one instant end evenly over one `wait`; each renewed at once is then
    held exactly `wait`, so the fleet renews at N / wait a second, evenly, from the first round."""
    wait, opened = 30.0, 1_800_000_000.123
    ends = [idle_poll_end(f"gpu-node-{n:05d}", wait, opened) - opened for n in range(10_000)]
    assert min(ends) > 0 and max(ends) <= wait
    tenths = [0] * 10
    for end in ends:
        tenths[min(9, int(end / wait * 10))] += 1
    assert all(900 <= n <= 1100 for n in tenths), tenths
    for n in range(0, 10_000, 997):
        first = opened + ends[n]
        renewed = idle_poll_end(f"gpu-node-{n:05d}", wait, first + 0.004)  # the agent's next poll
        assert abs(renewed - first - wait) < 1e-6
        assert idle_poll_end(f"gpu-node-{n:05d}", wait, first - 0.004) == pytest.approx(first)


async def _poll(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(url) as response:
        return response.status


def test_the_agent_backs_off_with_jitter_and_honours_retry_after() -> None:
    delays = [Backoff(rng=random.Random(seed)).next() for seed in range(200)]
    assert min(delays) >= 0.125 and max(delays) <= 0.25 and len({round(d, 4) for d in delays}) > 150
    backoff = Backoff(rng=random.Random(1))
    ceilings = [backoff.next() for _ in range(8)]
    assert ceilings[-1] <= 10.0 and ceilings[-1] >= 5.0  # doubled up to `most`, never past it
    told = [Backoff(rng=random.Random(seed)).next(retry_after=5.0) for seed in range(200)]
    assert min(told) >= 5.0 and max(told) <= 7.5 and max(told) - min(told) > 2.0  # spread, not lockstep


async def test_a_simulated_agent_whose_report_fails_polls_on_and_reports_again() -> None:
    """The bench's agents stand in for real ones: a report the service does not take (a restart cut
    it) ends neither the agent's poll loop nor its report, as in agent/loop.py. The reconnect storm
    once waited its full minute for an agent whose loop had died of a report cut by the restart."""
    deployment = {
        "id": "d1",
        "image": "r.example/app:1",
        "digest": "sha256:" + "0" * 64,
        "gpu_required": True,
    }
    polls = 0
    statuses: list[int] = []
    reported = asyncio.Event()

    async def poll(request: web.Request) -> web.Response:
        nonlocal polls
        polls += 1
        if reported.is_set():  # held, as a long poll with nothing new is
            await asyncio.sleep(float(request.query["wait"]))
        return web.json_response({"deployments": [deployment]})

    async def status(request: web.Request) -> web.Response:
        statuses.append(503 if not statuses else 200)
        if statuses[-1] == 200:
            reported.set()
        return web.json_response({"error": "restarting"} if statuses[-1] == 503 else {}, status=statuses[-1])

    app = web.Application()
    app.router.add_get("/api/agents/{name}/deployments", poll)
    app.router.add_post("/api/deployments/{id}/status", status)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    fleet = fleet_bench.Fleet(f"http://127.0.0.1:{port}", 0, 1, heartbeat=60.0, poll_wait=1.0, gpus=1)
    try:
        [agent] = fleet.agents
        fleet.start(agent)
        await asyncio.wait_for(reported.wait(), 10)
        assert statuses == [503, 200] and agent.reported == {"d1"} and "d1" in agent.received
        assert polls >= 2 and not agent.tasks[1].done()  # the poll loop lives on
    finally:
        await fleet.close()
        await runner.cleanup()
