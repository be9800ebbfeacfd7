"""A live fleet against one `gpubadge serve` on SQLite: N agents over real HTTP, heartbeating and long-polling.

One process simulates N agents with the agent's own HTTP client (`agent.service_client.ServiceClient`,
its jittered `Backoff`): each registers with 8 GPUs, beats every `--heartbeat` seconds at a
random phase, and holds a deployment long poll (one connection each; heartbeats share a
keep-alive pool). It raises its own file-descriptor limit to the hard limit and refuses an N
the limit cannot hold. Measured, in this order:

1. registration of N agents; the service's memory before and after N long polls are held;
2. eligibility over HTTP with no agent traffic (heartbeats paused, the polls held stay held and
   none is renewed: no agent request at all) and during the heartbeats, alternating quiet and
   loaded windows (side by side on the same service); after each quiet window the agents whose
   polls ended renew them over as long as the pause lasted, in the order they ended (not in
   one burst), and the next loaded window starts `--settle` seconds after that;
3. the service's CPU per heartbeat (from /proc/<pid>/stat): a window with heartbeats (and the
   idle polls that end meanwhile, each at its server's point of the cycle) less the CPU of a window
   with the heartbeats paused, divided by the heartbeats; also everything divided, and the CPU
   per poll renewal; and whether any heartbeat wrote the inventory (the stored rows' text is
   compared);
4. death and return: `--churn` of the agents killed at once, time until eligibility drops
   them (from their last heartbeat, against stale_after_seconds plus one check) and whether
   any other agent flapped; revived, time until all are eligible again;
5. deployments placed while the fleet beats: time from the 201 to the agent's poll answer;
6. a reconnect storm: the service restarted on the same database; time until every agent
   holds a long poll again, and eligibility answers (and failures) throughout.

`--postgres` runs the same fleet against two `serve` processes and one `worker` on PostgreSQL,
the agents spread over both APIs: the two APIs' answers compared side by side, eligibility with
and without agent traffic on each, death and return, deployments across the APIs, and the
reconnect storm with both APIs restarted at once (every agent loses its connection, as with one
service restarted).

The generators run at nice 10 (`--generator-nice`). A real fleet's agents spend their CPU on their
own servers; here, at the service's priority, they take its cores, and the service's answers wait
in a run queue for one. Each eligibility answer's wait (its loop thread's and the probe's, from
/proc schedstat) is measured, and the p99s net of it are printed beside the raw ones: at nice 0 on
2 cores the loaded tail is that wait (bench/RESULTS.md). `--generator-nice 0` measures that way.

`--agents 10000 --heartbeat 15` is the issue's fleet; the suite runs a small one
(tests/test_fleet_load.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import resource
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp

from agent.service_client import Backoff, ServiceClient, ServiceError
from bench.common import CLOCK_TICKS, percentile
from bench.placement_bench import REFERENCE, REGISTRY, REPOSITORY, TAG, gpu_report
from fixtures.registry import free_port
from fixtures.service import wait_healthy
from placement.inventory import Gpu, Server
from placement.protocol import DeploymentStatus
from store import SqliteStore, queries

STALL_LOGGED = 0.025  # the service logs every event-loop stall this long, with its stack (jobs/event_loop.py)
FD_HEADROOM = 400  # descriptors beyond one per agent's poll: heartbeat pool, eligibility, files
HEARTBEAT_POOL = 200  # keep-alive connections the agents' heartbeats share


def raise_fd_limit(needed: int) -> int:
    """Raise this process's soft descriptor limit to the hard one; the limit, or SystemExit if short."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    if needed > soft:
        raise SystemExit(
            f"{needed} descriptors needed, the hard limit is {soft}: run fewer agents per process"
        )
    return soft


def server_name(number: int) -> str:
    return f"agent-{number:05d}"


def server_of(number: int, gpus: int) -> Server:
    return Server(
        name=server_name(number),
        cpus=64,
        memory=512 * 1024**3,
        driver_version="535.104.05",
        cuda_driver_version="12.2",
        gpus=[
            Gpu(
                index=i,
                uuid=f"GPU-{number:05d}-{i}",
                name="NVIDIA H100 80GB HBM3",
                brand="Nvidia",
                memory_mib=81559,
                compute_capability="9.0",
            )
            for i in range(gpus)
        ],
        labels={"zone": "abc"[number % 3]},
    )


@dataclass
class SimAgent:
    """One simulated agent: its heartbeat and poll tasks, and what it saw."""

    server: Server
    last_beat: float = 0.0  # monotonic time of the last heartbeat the service accepted, or poll sent
    beats: int = 0
    poll_since: float | None = None  # monotonic time the current poll was sent, while in flight
    answered_since: float = 0.0  # monotonic time the last poll the service answered (200) was sent
    polls: int = 0  # polls the service answered
    received: dict[str, float] = field(default_factory=dict)  # deployment id -> when the poll got it
    reported: set[str] = field(default_factory=set)  # deployments the service accepted "running" for
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class Fleet:
    """The agents numbered `first` to `last` - 1, simulated in this process."""

    def __init__(
        self, url: str, first: int, last: int, heartbeat: float, poll_wait: float, gpus: int
    ) -> None:
        self.url = url
        self.heartbeat = heartbeat
        self.poll_wait = poll_wait
        self.agents = [SimAgent(server_of(n, gpus)) for n in range(first, last)]
        self.killed: list[SimAgent] = []
        self.beating = asyncio.Event()
        self.polling = asyncio.Event()  # cleared: an agent whose poll ends does not renew it
        self.polling.set()
        self.paused_at = 0.0  # monotonic time `polling` was last cleared
        self.sent = 0  # requests the agents sent (heartbeats and polls)
        self.errors: dict[str, int] = {}
        self._beat_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=HEARTBEAT_POOL), cookie_jar=aiohttp.DummyCookieJar()
        )
        self._poll_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), cookie_jar=aiohttp.DummyCookieJar()
        )
        self.beats = ServiceClient(url, "", self._beat_session)
        self.polls = ServiceClient(url, "", self._poll_session)

    async def close(self) -> None:
        for agent in self.agents:
            for task in agent.tasks:
                task.cancel()
        await asyncio.gather(*(t for a in self.agents for t in a.tasks), return_exceptions=True)
        await self._beat_session.close()
        await self._poll_session.close()

    def _error(self, exc: ServiceError) -> None:
        kind = str(exc).split(":", 2)[-1].strip()[:60]
        self.errors[kind] = self.errors.get(kind, 0) + 1

    async def register_all(self, concurrency: int = 32) -> float:
        started = time.perf_counter()
        gate = asyncio.Semaphore(concurrency)

        async def one(agent: SimAgent) -> None:
            async with gate:
                backoff = Backoff()
                while True:
                    try:
                        await self.beats.register(agent.server)
                        agent.last_beat = time.monotonic()
                        return
                    except ServiceError as exc:
                        self._error(exc)
                        await asyncio.sleep(backoff.next(exc.retry_after))

        await asyncio.gather(*(one(agent) for agent in self.agents))
        return time.perf_counter() - started

    def start(self, agent: SimAgent, beat_now: bool = False) -> None:
        agent.tasks = [
            asyncio.create_task(self._beat_loop(agent, beat_now)),
            asyncio.create_task(self._poll_loop(agent)),
        ]

    async def kill(self, agents: list[SimAgent]) -> None:
        tasks = [task for agent in agents for task in agent.tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for agent in agents:
            agent.tasks, agent.poll_since = [], None

    async def _beat_loop(self, agent: SimAgent, beat_now: bool) -> None:
        # the agent's own schedule (agent/loop.py): a random phase, then a little early each time
        delay = 0.0 if beat_now else self.heartbeat * random.uniform(0.0, 1.0)
        while True:
            await asyncio.sleep(delay)
            delay = self.heartbeat * random.uniform(0.9, 1.0)
            if not self.beating.is_set():
                continue  # paused: this beat is skipped, so the agents keep their spread phases
            self.sent += 1
            try:
                await self.beats.heartbeat(agent.server.name)
                agent.last_beat = time.monotonic()
                agent.beats += 1
            except ServiceError as exc:
                self._error(exc)

    async def _poll_loop(self, agent: SimAgent) -> None:
        backoff = Backoff()
        name = agent.server.name
        while True:
            if not self.polling.is_set():
                ended = time.monotonic()
                await self.polling.wait()
                # renewed as far into the resumption as the poll ended into the pause: the polls
                # held back renew spread as they ended, not in one burst at the service
                await asyncio.sleep(max(0.0, ended - self.paused_at))
            agent.poll_since = agent.last_beat = time.monotonic()  # a poll stamps the agent live too
            self.sent += 1
            try:
                deployments = await self.polls.poll_deployments(name, self.poll_wait)
                agent.answered_since = agent.poll_since or 0.0
                agent.polls += 1
                backoff.reset()
            except ServiceError as exc:
                agent.poll_since = None
                self._error(exc)
                await asyncio.sleep(backoff.next(exc.retry_after))
                continue
            agent.poll_since = None
            for deployment in deployments:
                agent.received.setdefault(deployment.id, time.monotonic())
                if deployment.id in agent.reported:
                    continue
                # As the agent does, a report the service did not take (it was restarting) is not
                # the end of the agent: it polls on, and reports when the deployment comes again.
                try:
                    await self.polls.report(deployment.id, DeploymentStatus(state="running"))
                    agent.reported.add(deployment.id)
                except ServiceError as exc:
                    self._error(exc)

    def total_beats(self) -> int:
        return sum(agent.beats for agent in self.agents)

    def total_polls(self) -> int:
        return sum(agent.polls for agent in self.agents)

    def holding(self, since: float, held_for: float = 1.0) -> int:
        """Agents whose current poll was sent after `since` and has been held `held_for` s, or
        whose poll sent after `since` the service has answered (the service ends an idle poll
        at its server's own point of the cycle, so at any moment some agents are between two polls)."""
        now = time.monotonic()
        return sum(
            1
            for agent in self.agents
            if agent.answered_since >= since
            or (
                agent.poll_since is not None
                and agent.poll_since >= since
                and now - agent.poll_since >= held_for
            )
        )

    async def command(self, name: str, args: dict[str, Any]) -> Any:
        """One command from the controlling process (`FleetProcesses`)."""
        if name == "register":
            return await self.register_all()
        if name == "start":
            for agent in self.agents:
                self.start(agent)
            return None
        if name == "beating":
            (self.beating.set if args["on"] else self.beating.clear)()
            return None
        if name == "quiet":  # no request at all: heartbeats paused, polls that end not renewed
            if args["on"]:
                self.paused_at = time.monotonic()
            for event in (self.beating, self.polling):
                (event.clear if args["on"] else event.set)()
            return None
        if name == "stats":
            return {
                "beats": self.total_beats(),
                "polls": self.total_polls(),
                "sent": self.sent,
                "holding": self.holding(args["since"], args["held_for"]),
                "errors": self.errors,
            }
        if name == "kill":
            self.killed = self.agents[len(self.agents) - args["count"] :]
            await self.kill(self.killed)
            return max((agent.last_beat for agent in self.killed), default=0.0)
        if name == "revive":
            for agent in self.killed:
                self.start(agent, beat_now=True)
            self.killed = []
            return None
        if name == "received":
            agent = next(a for a in self.agents if a.server.name == args["server"])
            return agent.received.get(args["id"])
        raise ValueError(f"unknown command {name}")


async def serve_commands(
    url: str, first: int, last: int, heartbeat: float, poll_wait: float, gpus: int
) -> None:
    """A generator process: JSON-line commands on stdin, one JSON-line answer each on stdout."""
    raise_fd_limit(last - first + HEARTBEAT_POOL + FD_HEADROOM)
    fleet = Fleet(url, first, last, heartbeat, poll_wait, gpus)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while line := await reader.readline():
            request = json.loads(line)
            if request["cmd"] == "close":
                break
            answer = await fleet.command(request["cmd"], request.get("args", {}))
            sys.stdout.write(json.dumps({"answer": answer}) + "\n")
            sys.stdout.flush()
    finally:
        await fleet.close()


class FleetProcesses:
    """N agents split over `procs` generator processes (each within its descriptor limit)."""

    def __init__(
        self,
        urls: list[str],
        count: int,
        procs: int,
        heartbeat: float,
        poll_wait: float,
        gpus: int,
        nice: int = 0,
    ) -> None:
        """Generator process i talks to `urls[i % len(urls)]` (agents spread over API processes).
        `nice` lowers the generators' CPU priority: they stand in for thousands of other machines,
        and on one small host they would otherwise take cores from the service they measure."""
        self.nice = nice
        self.count = count
        self.urls = urls
        bounds = [count * i // procs for i in range(procs + 1)]
        self.ranges = list(itertools.pairwise(bounds))
        self.options = (heartbeat, poll_wait, gpus)
        self.children: list[asyncio.subprocess.Process] = []
        self.killed_names: list[str] = []
        self._locks: list[asyncio.Lock] = []
        self._quiet_since = 0.0

    async def start(self) -> None:
        heartbeat, poll_wait, gpus = self.options
        for index, (first, last) in enumerate(self.ranges):
            url = self.urls[index % len(self.urls)]
            child = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "bench.fleet_bench", "--worker", url,
                "--range", f"{first}:{last}", "--heartbeat", f"{heartbeat:g}",
                "--poll-wait", f"{poll_wait:g}", "--gpus", str(gpus),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                preexec_fn=(lambda: os.nice(self.nice)) if self.nice else None,
            )  # fmt: skip
            self.children.append(child)
            self._locks.append(asyncio.Lock())

    async def call(self, index: int, cmd: str, **args: Any) -> Any:
        child = self.children[index]
        assert child.stdin is not None and child.stdout is not None
        async with self._locks[index]:
            child.stdin.write((json.dumps({"cmd": cmd, "args": args}) + "\n").encode())
            await child.stdin.drain()
            line = await child.stdout.readline()
        if not line:
            raise RuntimeError(f"generator process {index} exited")
        return json.loads(line)["answer"]

    async def all(self, cmd: str, **args: Any) -> list[Any]:
        return list(await asyncio.gather(*(self.call(i, cmd, **args) for i in range(len(self.children)))))

    def owner(self, server: str) -> int:
        number = int(server.rsplit("-", 1)[1])
        return next(i for i, (first, last) in enumerate(self.ranges) if first <= number < last)

    async def stats(self, since: float = 0.0, held_for: float = 1.0) -> dict[str, Any]:
        found = await self.all("stats", since=since, held_for=held_for)
        errors: dict[str, int] = {}
        for part in found:
            for kind, seen in part["errors"].items():
                errors[kind] = errors.get(kind, 0) + seen
        return {
            "beats": sum(part["beats"] for part in found),
            "polls": sum(part["polls"] for part in found),
            "sent": sum(part["sent"] for part in found),
            "holding": sum(part["holding"] for part in found),
            "errors": errors,
        }

    async def go_quiet(self) -> int:
        """No agent sends anything from here on: heartbeats paused, and an agent whose poll ends does
        not renew it (the polls held stay held). Returns the requests sent so far, for `resume`."""
        self._quiet_since = time.monotonic()
        await self.all("quiet", on=True)
        await asyncio.sleep(1.0)  # requests in flight finish
        return int((await self.stats())["sent"])

    async def resume(self, sent_before: int, settle: float) -> int:
        """Heartbeats and polls again, after `go_quiet`. The agents whose polls ended meanwhile renew
        them over as long as the pause lasted, in the order they ended (at once, they were a burst
        whose wake lasted past 10 s on the next loaded window: p99 20-31 ms against 7-12 ms), so the
        next window starts that long plus `settle` seconds later. Returns the requests sent while
        quiet (0: the quiet windows had no agent traffic)."""
        sent_quiet = int((await self.stats())["sent"]) - sent_before
        paused = time.monotonic() - self._quiet_since
        await self.all("quiet", on=False)
        await asyncio.sleep(paused + settle)
        return sent_quiet

    async def delivered(self, owner: int, server: str, deployment: str, timeout: float) -> float:
        """When `server`'s poll got `deployment` (monotonic); asks its process until then (bounded)."""
        deadline = time.monotonic() + timeout
        while (when := await self.call(owner, "received", server=server, id=deployment)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{deployment} never reached {server}")
            await asyncio.sleep(0.005)
        return float(when)

    async def kill(self, count: int) -> float:
        """Kill `count` agents spread over the processes; the latest last heartbeat among them."""
        shares = [count * (last - first) // self.count for first, last in self.ranges]
        shares[-1] += count - sum(shares)
        beats = await asyncio.gather(*(self.call(i, "kill", count=share) for i, share in enumerate(shares)))
        self.killed_names = [
            server_name(number) for (_, last), share in zip(self.ranges, shares, strict=True)
            for number in range(last - share, last)
        ]  # fmt: skip
        return max(beats)

    async def close(self) -> None:
        for child in self.children:
            if child.returncode is None and child.stdin is not None:
                with contextlib.suppress(Exception):
                    child.stdin.write(b'{"cmd": "close"}\n')
                    await child.stdin.drain()
        for child in self.children:
            try:
                await asyncio.wait_for(child.wait(), 30)
            except TimeoutError:
                child.kill()
                await child.wait()


class Service:
    """`gpubadge serve` on a SQLite file, restartable on the same port and file."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            **env,
            "GPUBADGE_PORT": str(self.port),
            "GPUBADGE_DB": str(workdir / "fleet.db"),
            "GPUBADGE_ALLOW_AGENTS_WITHOUT_TOKEN": "true",  # the simulated agents present no token
        }
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with (self.workdir / "service.log").open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "gpubadge.cli", "serve", "--workers", "0", "--log-level", "WARNING"],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_healthy(self.url, self.process, timeout=120)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0


def seed_store(db: Path) -> None:
    store = SqliteStore(db)
    report = gpu_report()
    store.run(queries.save_report, report)
    store.run(queries.record_tag, REGISTRY, REPOSITORY, TAG, report.digest or "")
    store.close()


def inventories(db: Path) -> dict[str, str]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return dict(conn.execute("SELECT name, inventory FROM servers").fetchall())


def reserved_of(db: Path, deployments: list[str]) -> list[str]:
    """Which of `deployments` still hold GPU reservations."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        rows = conn.execute("SELECT DISTINCT deployment_id FROM reservations").fetchall()
    return [row[0] for row in rows if row[0] in set(deployments)]


@dataclass
class Eligibility:
    """Sequential eligibility queries on one keep-alive connection, as a scheduler asks them."""

    url: str
    session: aiohttp.ClientSession
    pid_of: Callable[[], int] | None = None  # the service's process: its loop's wait for a core
    latencies: list[float] = field(default_factory=list)
    handler: list[float] = field(default_factory=list)
    # each windowed answer's latency less the time the service's loop and the probe spent waiting
    # for a core meanwhile (bench.eligibility_probe): the part the host's other load does not decide
    net: list[float] = field(default_factory=list)
    failures: int = 0
    body: bytes = json.dumps({"image": REFERENCE, "gpus": 1, "limit": 10}).encode()

    async def once(self) -> int | None:
        started = time.perf_counter()
        try:
            async with self.session.post(
                self.url + "/api/eligibility",
                data=self.body,
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=10),
            ) as response:
                data = await response.json()
                if response.status != 200:
                    self.failures += 1
                    return None
        except (aiohttp.ClientError, TimeoutError):
            self.failures += 1
            return None
        self.latencies.append(time.perf_counter() - started)
        return int(data["eligible_count"])

    async def window(self, seconds: float) -> list[float]:
        """Latencies of queries for `seconds`, asked from a process of their own (`probe`), so the
        simulated agents' event loop never delays a measured answer."""
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.eligibility_probe",
            self.url,
            f"{seconds:g}",
            self.body.decode(),
            *([str(self.pid_of())] if self.pid_of else []),
            stdout=asyncio.subprocess.PIPE,
        )
        output, _ = await process.communicate()
        found = json.loads(output)
        self.failures += found["failures"]
        self.latencies += found["latencies"]
        self.handler += found["handler"]
        spans = zip(found["latencies"], found["waited"], strict=True)
        self.net += [max(latency - waited, 0.0) for latency, waited in spans]
        return list(found["latencies"])


def logged_stalls(log: Path, spans: list[tuple[float, float]]) -> list[tuple[float, str]]:
    """The event-loop stalls the service logged (jobs/event_loop.py) that ended inside one of `spans`,
    longest first: (seconds, the innermost frame of the loop thread's stack)."""
    found: list[tuple[float, str]] = []
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    for number, line in enumerate(lines):
        if "the event loop stalled for" not in line:
            continue
        try:
            moment = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            seconds = float(line.split("stalled for ", 1)[1].split(" ms", 1)[0]) / 1000
        except (ValueError, IndexError):
            continue
        if not any(start <= moment <= end for start, end in spans):
            continue
        frames = []
        for later in lines[number + 1 :]:
            if later.startswith("other threads:") or later[:4].isdigit():
                break
            if later.strip().startswith('File "'):
                path, _, rest = later.strip()[6:].partition('", line ')
                frames.append(f"{path.rpartition('/')[2]}:{rest.replace(', in ', ' ')}")
        found.append((seconds, frames[-1] if frames else "?"))
    return sorted(found, reverse=True)


def warm_up(args: argparse.Namespace) -> float:
    """Seconds the heartbeats run before the first window: two intervals and a poll's whole wait,
    so every agent beats on its own phase and has renewed its first poll. (The first loaded window
    used to come out at about twice the p99 of the later ones, with or without this warm-up: the
    service's young collections, 40-180 ms each, came at random and a few fell in it. `serve`
    now schedules them: web/garbage_collection.py, bench/RESULTS.md.)"""
    return max(2 * args.heartbeat, args.poll_wait)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


async def wait_until(check: Callable[[], Awaitable[bool]], timeout: float, step: float = 0.1) -> float:
    """Seconds until `check()` holds (bounded); raises TimeoutError past `timeout`."""
    started = time.monotonic()
    while not await check():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"not within {timeout} s")
        await asyncio.sleep(step)
    return time.monotonic() - started


async def heartbeat_cost(
    fleet: FleetProcesses, cpu_seconds: Callable[[], float], args: argparse.Namespace
) -> dict[str, float]:
    """The service's CPU per heartbeat (`cpu_seconds`: every API process's together), net of the idle
    polls renewed meanwhile: a window with heartbeats only (polls held, no queries), then one with the
    heartbeats paused for a poll's wait, in which every idle poll renews, for the CPU per renewal.
    Idle polls end spread evenly over their wait, so the heartbeats' window holds renewals too;
    theirs is taken off before dividing by the heartbeats. The heartbeats have run again for one
    interval on return."""
    before = await fleet.stats()
    cpu0, t0 = cpu_seconds(), time.monotonic()
    await asyncio.sleep(args.window)
    cpu, elapsed, after = cpu_seconds() - cpu0, time.monotonic() - t0, await fleet.stats()
    beats, polls_a = after["beats"] - before["beats"], after["polls"] - before["polls"]
    await fleet.all("beating", on=False)
    await asyncio.sleep(1.0)  # beats in flight finish
    polls0, cpu_b0, t_b0 = (await fleet.stats())["polls"], cpu_seconds(), time.monotonic()
    await asyncio.sleep(args.poll_wait)  # every idle poll ends once or more (and stamps its agent)
    polls, cpu_b, elapsed_b = (
        (await fleet.stats())["polls"] - polls0,
        cpu_seconds() - cpu_b0,
        time.monotonic() - t_b0,
    )
    await fleet.all("beating", on=True)
    # one interval: every agent beats again before what is measured next (right after the pause the
    # APIs' loaded eligibility p99 came out about twice as high, 19-23 ms against 9-12 ms)
    await asyncio.sleep(args.heartbeat)
    per_poll = 1000 * cpu_b / max(polls, 1)
    return {
        "heartbeats_per_second": beats / elapsed,
        "cpu_ms_per_heartbeat_all": 1000 * cpu / max(beats, 1),
        "cpu_ms_per_poll": per_poll,
        "cpu_ms_per_heartbeat": (1000 * cpu - polls_a * per_poll) / max(beats, 1),
        "service_cpu_share": cpu / elapsed,
        "polls_renewed_per_second": polls_a / elapsed,
        "polls_renewed_paused_per_second": polls / elapsed_b,
    }


async def run(args: argparse.Namespace, out: dict[str, Any]) -> None:
    count = args.agents
    procs = args.procs or max(1, -(-count // 2500))
    out["procs"] = procs
    workdir = Path(tempfile.mkdtemp(prefix="gpubadge-fleet-"))
    seed_store(workdir / "fleet.db")
    env = {
        "GPUBADGE_HEARTBEAT_SECONDS": f"{args.heartbeat:g}",
        "GPUBADGE_STALE_AFTER_SECONDS": f"{args.stale:g}",
        "GPUBADGE_HEARTBEAT_FLUSH_SECONDS": f"{args.flush:g}",
        "GPUBADGE_LONG_POLL_MAX": str(args.long_poll_max or count + 100),
        "GPUBADGE_LOOP_STALL_SECONDS": f"{STALL_LOGGED:g}",  # what held the loop, in the service's log
    }
    service = Service(workdir, env)
    service.start()
    fleet = FleetProcesses(
        [service.url], count, procs, args.heartbeat, args.poll_wait, args.gpus, args.generator_nice
    )
    await fleet.start()
    query_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
    eligibility = Eligibility(service.url, query_session, lambda: service.pid)
    report: list[str] = []

    def say(line: str) -> None:
        report.append(line)
        print(line, flush=True)

    try:
        started = time.perf_counter()
        await fleet.all("register")
        out["register_seconds"] = time.perf_counter() - started
        say(f"registered {count} agents in {out['register_seconds']:.1f} s ({procs} generator processes)")
        assert await eligibility.once() == count
        before = service.rss_bytes()
        opened = time.monotonic()
        await fleet.all("start")  # heartbeats wait for `beating`; polls go out now

        async def all_holding(since: float) -> bool:
            return bool((await fleet.stats(since, 0.5))["holding"] == count)

        await wait_until(lambda: all_holding(opened), 120)
        await asyncio.sleep(1.0)
        after = service.rss_bytes()
        out["bytes_per_poll"] = (after - before) / count
        say(
            f"memory: {before / 2**20:.0f} MiB -> {after / 2**20:.0f} MiB with {count} polls held:"
            f" {out['bytes_per_poll'] / 1024:.1f} KiB per held long poll"
        )
        stored_before = inventories(workdir / "fleet.db")

        quiet: list[float] = []
        loaded: list[float] = []
        await fleet.all("beating", on=True)
        await asyncio.sleep(warm_up(args))
        quiet_handler: list[float] = []
        loaded_handler: list[float] = []
        quiet_net: list[float] = []
        loaded_net: list[float] = []
        sent_quiet = 0
        windows: list[tuple[str, float]] = []  # each window's own p99, in order
        spans: list[tuple[float, float]] = []  # each window, from its start to its end (wall time)
        for _ in range(args.rounds):
            mark, net_mark = len(eligibility.handler), len(eligibility.net)
            began = time.time()
            loaded += (found := await eligibility.window(args.window))
            spans.append((began, time.time()))
            windows.append(("loaded", percentile(found, 0.99)))
            loaded_handler += eligibility.handler[mark:]
            loaded_net += eligibility.net[net_mark:]
            sent = await fleet.go_quiet()
            mark, net_mark = len(eligibility.handler), len(eligibility.net)
            began = time.time()
            quiet += (found := await eligibility.window(min(args.window, args.stale / 3)))
            spans.append((began, time.time()))
            windows.append(("quiet", percentile(found, 0.99)))
            quiet_handler += eligibility.handler[mark:]
            quiet_net += eligibility.net[net_mark:]
            sent_quiet += await fleet.resume(sent, args.settle)
        out["quiet_net_p99"], out["loaded_net_p99"] = (
            percentile(quiet_net, 0.99),
            percentile(loaded_net, 0.99),
        )
        out["requests_sent_quiet"] = sent_quiet
        out["window_p99s"] = windows
        out["quiet_handler_p99"] = percentile(quiet_handler, 0.99)
        out["loaded_handler_p99"] = percentile(loaded_handler, 0.99)
        out["load_average"] = os.getloadavg()[0]
        out["quiet_p50"], out["quiet_p99"] = percentile(quiet, 0.5), percentile(quiet, 0.99)
        out["loaded_p50"], out["loaded_p99"] = percentile(loaded, 0.5), percentile(loaded, 0.99)
        out["quiet_max"], out["loaded_max"] = max(quiet, default=0.0), max(loaded, default=0.0)
        say(
            f"eligibility, no agent traffic (heartbeats paused, polls held, none renewed: {sent_quiet} agent"
            f" requests): p50 {ms(out['quiet_p50'])}, p99 {ms(out['quiet_p99'])}, max {ms(out['quiet_max'])}"
            f" ({len(quiet)} queries)"
        )
        say(
            f"eligibility, during heartbeats: p50 {ms(out['loaded_p50'])}, p99 {ms(out['loaded_p99'])},"
            f" max {ms(out['loaded_max'])} ({len(loaded)} queries); ratio p99"
            f" {out['loaded_p99'] / out['quiet_p99']:.2f}x; each window's p99 in"
            f" order: {', '.join(f'{kind} {ms(p99)}' for kind, p99 in windows)}"
        )
        stalls = logged_stalls(workdir / "service.log", spans)
        out["window_stalls"] = [(round(seconds * 1000), where) for seconds, where in stalls]
        say(
            f"the service's event loop in those windows: {len(stalls)} stall(s) of {STALL_LOGGED * 1000:.0f} ms or"
            " more" + "".join(f"; {seconds * 1000:.0f} ms in {where}" for seconds, where in stalls[:3])
        )
        say(
            f"eligibility, the answers' own `seconds` (index and decide, no queueing): p99"
            f" {ms(out['quiet_handler_p99'])} quiet, {ms(out['loaded_handler_p99'])} during heartbeats;"
            f" host load average {out['load_average']:.1f} on {os.cpu_count()} cores"
        )
        say(
            f"eligibility, net of waiting for a core (the service's loop and the probe in a run queue):"
            f" p99 {ms(out['quiet_net_p99'])} quiet, {ms(out['loaded_net_p99'])} during heartbeats;"
            f" ratio {out['loaded_net_p99'] / out['quiet_net_p99']:.2f}x"
        )
        # after the windows, as on PostgreSQL: right after its pause of the heartbeats (a poll's wait),
        # the first loaded window's p99 came out 7-12 ms against 5 ms for a later one
        cost = await heartbeat_cost(fleet, service.cpu_seconds, args)
        out.update(cost)
        say(
            f"heartbeats: {cost['heartbeats_per_second']:.0f}/s held; service CPU {cost['service_cpu_share']:.0%} of a"
            f" core with {cost['polls_renewed_per_second']:.0f} idle polls renewed/s; with the heartbeats paused"
            f" {cost['polls_renewed_paused_per_second']:.0f} renewed/s at {cost['cpu_ms_per_poll']:.3f} ms each"
            f" (everything the service did, divided): {cost['cpu_ms_per_heartbeat']:.3f} ms per heartbeat, net of the"
            f" renewals ({cost['cpu_ms_per_heartbeat_all']:.3f} ms: everything the service did, divided by the heartbeats)"
        )
        stored_after = inventories(workdir / "fleet.db")
        out["inventories_rewritten"] = sum(stored_before[n] != stored_after.get(n) for n in stored_before)
        say(f"inventories rewritten by heartbeats: {out['inventories_rewritten']}")

        # death and return
        killed_count = int(count * args.churn)
        print(f"killing {killed_count} agents", flush=True)
        last_beat = await fleet.kill(killed_count)
        killed_at = time.monotonic()
        print(f"killed ({killed_at - last_beat:.1f} s after their last contact)", flush=True)
        floor = count - killed_count
        flaps = 0
        dropped_at = None
        deadline = killed_at + args.stale + args.heartbeat + 10
        while time.monotonic() < deadline:
            seen = await eligibility.once()
            if seen is not None and seen < floor:
                flaps += 1
            if seen == floor:
                dropped_at = time.monotonic()
                break
            await asyncio.sleep(0.1)
        out["flaps"] = flaps
        out["drop_after_last_beat"] = (dropped_at - last_beat) if dropped_at else None
        out["drop_after_kill"] = (dropped_at - killed_at) if dropped_at else None
        say(
            f"{killed_count} agents killed: out of eligibility {out['drop_after_kill']:.1f} s after the kill,"
            f" {out['drop_after_last_beat']:.1f} s after their last heartbeat (stale_after_seconds {args.stale:g});"
            f" answers below the {floor} live agents: {flaps}"
            if dropped_at
            else "dead agents never dropped out"
        )
        await fleet.all("revive")

        async def all_back() -> bool:
            return await eligibility.once() == count

        out["return_seconds"] = await wait_until(all_back, args.heartbeat + 10, 0.05)
        say(
            f"revived: all {killed_count} eligible again {out['return_seconds']:.2f} s after they started"
            f" (one heartbeat interval: {args.heartbeat:g} s)"
        )

        # deployments reach their agents
        delays = []
        placements: dict[str, str] = {}
        async with aiohttp.ClientSession() as deploy_session:
            for _ in range(args.deployments):
                placed = time.monotonic()  # the deploy request sent: its placement is in the answer
                async with deploy_session.post(
                    service.url + "/api/deployments", json={"image": REFERENCE, "gpus": 1}
                ) as response:
                    body = await response.json()
                    assert response.status == 201, body
                owner, server, deployment = fleet.owner(body["server"]), body["server"], body["id"]
                placements[deployment] = server
                delays.append(await fleet.delivered(owner, server, deployment, timeout=10) - placed)
        out["deploy_max"] = max(delays) if delays else 0.0
        say(
            f"deployments: {len(delays)} placed, reached their agent in p50 {ms(percentile(delays, 0.5))},"
            f" max {ms(out['deploy_max'])}"
        )

        # reconnect storm
        storm_failures_before = eligibility.failures
        restart_at = time.monotonic()
        await asyncio.to_thread(service.stop)
        down_at = (
            time.monotonic()
        )  # the old process has exited: a poll sent from here on is held by the new one
        await asyncio.to_thread(service.start)
        up_at = time.monotonic()
        # eligibility from the moment the service is back, for as long as the agents reconnect
        watcher = asyncio.create_task(eligibility.window(args.window))
        try:
            out["storm_seconds"] = await wait_until(lambda: all_holding(down_at), args.storm_limit, 0.1)
        finally:
            storm = await watcher
        out["storm_restart_seconds"] = up_at - restart_at
        out["storm_p99"] = percentile(storm, 0.99) if storm else None
        out["storm_failures"] = eligibility.failures - storm_failures_before
        say(
            f"reconnect storm: service stopped and back in {out['storm_restart_seconds']:.1f} s; all {count} agents"
            f" hold a poll on it {out['storm_seconds']:.1f} s after it answered; eligibility during the storm:"
            f" {len(storm)} answers, p99 {ms(out['storm_p99'] or 0)}, {out['storm_failures']} failed"
        )
        errors = (await fleet.stats())["errors"]
        say(f"agent-side errors seen: {dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5])}")
        every = logged_stalls(workdir / "service.log", [(0.0, time.time())])
        out["run_stalls"] = [(round(seconds * 1000), where) for seconds, where in every]
        say(
            f"the service's event loop over the whole run: {len(every)} stall(s) of {STALL_LOGGED * 1000:.0f} ms or"
            " more (startup, the kill, the storm included)"
            + "".join(f"; {seconds * 1000:.0f} ms in {where}" for seconds, where in every[:5])
        )
    finally:
        out["lines"] = report
        await query_session.close()
        await fleet.close()
        service.stop()


async def run_postgres_fleet(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """The same fleet on PostgreSQL: two `serve` processes and one `worker`, the agents spread over
    both APIs. Eligibility is asked of both side by side: how often, and for how long, they differ."""
    from fixtures.postgres import run_postgres
    from store.postgres import PostgresStore

    count = args.agents
    procs = args.procs or max(2, -(-count // 2500))
    workdir = Path(tempfile.mkdtemp(prefix="gpubadge-fleet-pg-"))
    report: list[str] = []

    def say(line: str) -> None:
        report.append(line)
        print(line, flush=True)

    with run_postgres() as postgres:
        url = postgres.create_database("fleet")
        store = PostgresStore(url)
        gpu = gpu_report()
        store.run(queries.save_report, gpu)
        store.run(queries.record_tag, REGISTRY, REPOSITORY, TAG, gpu.digest or "")
        store.close()
        env = {
            "GPUBADGE_DATABASE_URL": url,
            "GPUBADGE_HEARTBEAT_SECONDS": f"{args.heartbeat:g}",
            "GPUBADGE_STALE_AFTER_SECONDS": f"{args.stale:g}",
            "GPUBADGE_HEARTBEAT_FLUSH_SECONDS": f"{args.flush:g}",
            "GPUBADGE_LONG_POLL_MAX": str(count + 100),
        }
        apis = [Service(workdir, env), Service(workdir, env)]
        for api in apis:
            api.start()
        worker_log = (workdir / "worker.log").open("ab")
        worker = subprocess.Popen(
            [sys.executable, "-m", "gpubadge.cli", "worker", "--log-level", "WARNING"],
            env={**os.environ, **env},
            stdout=worker_log,
            stderr=subprocess.STDOUT,
        )
        fleet = FleetProcesses(
            [api.url for api in apis],
            count,
            procs,
            args.heartbeat,
            args.poll_wait,
            args.gpus,
            args.generator_nice,
        )
        await fleet.start()
        sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) for _ in apis]
        asks = [
            Eligibility(api.url, session, lambda api=api: api.pid)  # type: ignore[misc]
            for api, session in zip(apis, sessions, strict=True)
        ]
        try:
            started = time.perf_counter()
            await fleet.all("register")
            say(
                f"PostgreSQL: registered {count} agents over 2 API processes in {time.perf_counter() - started:.1f} s"
            )
            before = sum(api.rss_bytes() for api in apis)
            opened = time.monotonic()
            await fleet.all("start")

            async def all_holding(since: float) -> bool:
                return bool((await fleet.stats(since, 0.5))["holding"] == count)

            await wait_until(lambda: all_holding(opened), 120)
            await asyncio.sleep(1.0)
            after = sum(api.rss_bytes() for api in apis)
            out["pg_bytes_per_poll"] = (after - before) / count
            say(
                f"PostgreSQL: both APIs' memory {before / 2**20:.0f} MiB -> {after / 2**20:.0f} MiB with {count}"
                f" polls held: {out['pg_bytes_per_poll'] / 1024:.1f} KiB per held long poll"
            )
            await fleet.all("beating", on=True)
            await asyncio.sleep(warm_up(args))
            beats0, t0 = (await fleet.stats())["beats"], time.monotonic()
            cpu0 = sum(api.cpu_seconds() for api in apis)
            agree = differ = 0
            longest = 0.0
            differing_since: float | None = None
            deadline = time.monotonic() + args.window
            while time.monotonic() < deadline:
                counts = await asyncio.gather(*(ask.once() for ask in asks))
                now = time.monotonic()
                if None not in counts and counts[0] == counts[1]:
                    agree += 1
                    differing_since = None
                else:
                    differ += 1
                    differing_since = differing_since or now
                    longest = max(longest, now - differing_since)
                await asyncio.sleep(0.05)
            beats, elapsed = (await fleet.stats())["beats"] - beats0, time.monotonic() - t0
            cpu = sum(api.cpu_seconds() for api in apis) - cpu0
            out["pg_heartbeats_per_second"] = beats / elapsed
            out["pg_cpu_ms_per_heartbeat"] = 1000 * cpu / max(beats, 1)
            say(
                f"PostgreSQL: {beats / elapsed:.0f} heartbeats/s; both APIs' CPU {out['pg_cpu_ms_per_heartbeat']:.3f} ms"
                f" per heartbeat (with the side-by-side eligibility queries); answers agreeing: {agree} of"
                f" {agree + differ}, longest disagreement {longest:.2f} s"
            )
            # eligibility with and without the agents' traffic, side by side on each API
            loaded: list[list[float]] = [[], []]
            quiet: list[list[float]] = [[], []]
            loaded_handler: list[list[float]] = [[], []]
            quiet_handler: list[list[float]] = [[], []]
            loaded_net: list[list[float]] = [[], []]
            quiet_net: list[list[float]] = [[], []]
            out["pg_load_average_before"] = os.getloadavg()[0]
            sent_quiet = 0
            windows: list[list[tuple[str, float]]] = [[], []]  # each window's own p99, in order
            for _ in range(args.rounds):
                for i, ask in enumerate(asks):
                    mark, net_mark = len(ask.handler), len(ask.net)
                    loaded[i] += (found := await ask.window(args.window))
                    windows[i].append(("loaded", percentile(found, 0.99)))
                    loaded_handler[i] += ask.handler[mark:]
                    loaded_net[i] += ask.net[net_mark:]
                sent = await fleet.go_quiet()
                for i, ask in enumerate(asks):
                    mark, net_mark = len(ask.handler), len(ask.net)
                    quiet[i] += (found := await ask.window(min(args.window, args.stale / 6)))
                    windows[i].append(("quiet", percentile(found, 0.99)))
                    quiet_handler[i] += ask.handler[mark:]
                    quiet_net[i] += ask.net[net_mark:]
                sent_quiet += await fleet.resume(sent, args.settle)
            out["pg_load_average_after"] = os.getloadavg()[0]
            out["pg_requests_sent_quiet"] = sent_quiet
            out["pg_window_p99s"] = windows
            for key, found in (
                ("loaded", loaded),
                ("quiet", quiet),
                ("loaded_handler", loaded_handler),
                ("quiet_handler", quiet_handler),
                ("loaded_net", loaded_net),
                ("quiet_net", quiet_net),
            ):
                out[f"pg_{key}_p50"] = [percentile(x, 0.5) for x in found]
                out[f"pg_{key}_p99"] = [percentile(x, 0.99) for x in found]
            for i in range(2):
                say(
                    f"PostgreSQL: eligibility on API {i + 1}, no agent traffic ({sent_quiet} agent requests): p50 {ms(out['pg_quiet_p50'][i])},"
                    f" p99 {ms(out['pg_quiet_p99'][i])} ({len(quiet[i])} queries); during heartbeats: p50"
                    f" {ms(out['pg_loaded_p50'][i])}, p99 {ms(out['pg_loaded_p99'][i])} ({len(loaded[i])} queries);"
                    f" ratio p99 {out['pg_loaded_p99'][i] / out['pg_quiet_p99'][i]:.2f}x; the answers' own"
                    f" `seconds` p99 {ms(out['pg_quiet_handler_p99'][i])} quiet,"
                    f" {ms(out['pg_loaded_handler_p99'][i])} loaded; each window's p99 in order:"
                    f" {', '.join(f'{kind} {ms(p99)}' for kind, p99 in windows[i])}; net of waiting for a core"
                    f" (API {i + 1}'s loop and the probe in a run queue): p99 {ms(out['pg_quiet_net_p99'][i])} quiet,"
                    f" {ms(out['pg_loaded_net_p99'][i])} loaded, ratio"
                    f" {out['pg_loaded_net_p99'][i] / out['pg_quiet_net_p99'][i]:.2f}x"
                )
            say(
                f"PostgreSQL: host load average {out['pg_load_average_before']:.1f} before these windows,"
                f" {out['pg_load_average_after']:.1f} after, on {os.cpu_count()} cores"
            )
            # CPU per heartbeat net of the poll renewals, after the eligibility windows (as main's baseline
            # measured them, 25-65 s after the polls opened)
            cost = await heartbeat_cost(fleet, lambda: sum(api.cpu_seconds() for api in apis), args)
            out.update({f"pg_{key}": value for key, value in cost.items()})
            say(
                f"PostgreSQL: heartbeats only (polls held, no queries): {cost['heartbeats_per_second']:.0f}/s; both"
                f" APIs' CPU {cost['service_cpu_share']:.0%} of a core with {cost['polls_renewed_per_second']:.0f}"
                f" idle polls renewed/s; a renewal {cost['cpu_ms_per_poll']:.3f} ms (heartbeats paused):"
                f" {cost['cpu_ms_per_heartbeat']:.3f} ms per heartbeat net of the renewals"
                f" ({cost['cpu_ms_per_heartbeat_all']:.3f} ms: everything both APIs did, divided by the heartbeats)"
            )
            # a deployment placed through API 1 for an agent polling API 2 (NOTIFY across processes)
            delays = []
            async with aiohttp.ClientSession() as deploy_session:
                for _ in range(args.deployments):
                    placed = time.monotonic()
                    async with deploy_session.post(
                        apis[0].url + "/api/deployments", json={"image": REFERENCE, "gpus": 1}
                    ) as response:
                        body = await response.json()
                        assert response.status == 201, body
                    owner = fleet.owner(body["server"])
                    delays.append(
                        await fleet.delivered(owner, body["server"], body["id"], timeout=10) - placed
                    )
            out["pg_deploy_max"] = max(delays)
            say(
                f"PostgreSQL: deployments through API 1 reached their agent (either API) in max {ms(max(delays))}"
            )
            # death: both APIs drop the killed agents
            killed = int(count * args.churn)
            baseline = await asks[0].once()  # all agents, less any server the deployments filled
            assert baseline is not None
            last = await fleet.kill(killed)
            floor = baseline - killed
            dropped: list[float | None] = [None, None]
            flaps = 0
            limit = time.monotonic() + args.stale + args.heartbeat + 20
            while None in dropped and time.monotonic() < limit:
                counts = await asyncio.gather(*(ask.once() for ask in asks))
                for i, seen in enumerate(counts):
                    if seen is not None and seen < floor:
                        flaps += 1
                    if seen == floor and dropped[i] is None:
                        dropped[i] = time.monotonic() - last
                await asyncio.sleep(0.1)
            out["pg_drop_after_last_contact"] = dropped
            out["pg_flaps"] = flaps
            say(
                f"PostgreSQL: {killed} agents killed; out of eligibility on API 1 / API 2 "
                + " / ".join(f"{d:.1f} s" if d is not None else "never" for d in dropped)
                + f" after their last contact (stale_after_seconds {args.stale:g}); answers below the live count: {flaps}"
            )
            await fleet.all("revive")

            async def both_back() -> bool:
                return all(seen == baseline for seen in await asyncio.gather(*(ask.once() for ask in asks)))

            out["pg_return_seconds"] = await wait_until(both_back, args.heartbeat + 20, 0.05)
            say(
                f"PostgreSQL: revived agents eligible on both APIs again after {out['pg_return_seconds']:.2f} s"
            )

            # reconnect storm: both APIs restarted at once, so every agent loses its connection
            failures_before = [ask.failures for ask in asks]
            restart_at = time.monotonic()
            await asyncio.gather(*(asyncio.to_thread(api.stop) for api in apis))
            down_at = time.monotonic()  # a poll sent from here on is held by a new process
            await asyncio.gather(*(asyncio.to_thread(api.start) for api in apis))
            up_at = time.monotonic()
            watchers = [asyncio.create_task(ask.window(args.window)) for ask in asks]
            try:
                out["pg_storm_seconds"] = await wait_until(
                    lambda: all_holding(down_at), args.storm_limit, 0.1
                )
            finally:
                storm = [await watcher for watcher in watchers]
            out["pg_storm_restart_seconds"] = up_at - restart_at
            out["pg_storm_p99"] = [percentile(x, 0.99) if x else None for x in storm]
            out["pg_storm_failures"] = sum(ask.failures for ask in asks) - sum(failures_before)
            out["pg_storm_eligible"] = [
                await ask.once() or await ask.once() for ask in asks
            ]  # a new connection
            say(
                f"PostgreSQL reconnect storm: both APIs stopped and back in {out['pg_storm_restart_seconds']:.1f} s;"
                f" all {count} agents hold a poll again {out['pg_storm_seconds']:.1f} s after they answered;"
                " eligibility meanwhile on API 1 / API 2: "
                + " / ".join(
                    f"{len(x)} answers, p99 {ms(percentile(x, 0.99))}" if x else "none" for x in storm
                )
                + f", {out['pg_storm_failures']} failed; eligible after it: {out['pg_storm_eligible']}"
            )
            errors = (await fleet.stats())["errors"]
            say(
                f"PostgreSQL: agent-side errors seen: {dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5])}"
            )
        finally:
            out["pg_lines"] = report
            for session in sessions:
                await session.close()
            await fleet.close()
            for api in apis:
                api.stop()
            worker.terminate()
            worker.wait(timeout=30)
            worker_log.close()


async def _true(value: bool) -> bool:
    return value


def run_all(results: Any, quick: bool) -> None:
    """bench/run.py's `fleet` section: the issue's fleet (10,000 agents, 15 s heartbeats, 45 s
    stale), or 1,000 agents with `--quick`, as figures against the issue's targets."""
    from bench.common import Figure

    agents = 1000 if quick else 10000
    f = main([f"--agents={agents}", "--heartbeat=15", "--stale=45", "--window=10", "--rounds=2"])
    for line in f["lines"]:
        results.detail(f"fleet: {line}")
    section = "fleet"
    results.add(
        Figure(
            section,
            f"heartbeats/s held by {agents:,} agents; service CPU per heartbeat",
            f"{f['heartbeats_per_second']:.0f}/s; {f['cpu_ms_per_heartbeat']:.3f} ms"
            f" ({f['cpu_ms_per_heartbeat_all']:.3f} ms with the polls renewed meanwhile;"
            f" a poll renewal {f['cpu_ms_per_poll']:.3f} ms; {f['inventories_rewritten']} inventories rewritten)",
            target="<= 0.4 ms, no inventory written",
            met=f["cpu_ms_per_heartbeat"] <= 0.4 and f["inventories_rewritten"] == 0,
        )
    )
    results.add(
        Figure(
            section,
            "POST /api/eligibility during the agents' traffic vs without it",
            f"p50 {ms(f['loaded_p50'])}, p99 {ms(f['loaded_p99'])}",
            peer=f"p50 {ms(f['quiet_p50'])}, p99 {ms(f['quiet_p99'])}",
            ratio=f["quiet_p99"] / f["loaded_p99"] if f["loaded_p99"] else None,
            target="p99 < 25 ms and within 2x",
            met=f["loaded_p99"] < 0.025 and f["loaded_p99"] <= 2 * f["quiet_p99"],
        )
    )
    results.add(
        Figure(
            section,
            "service memory per held long poll",
            f"{f['bytes_per_poll'] / 1024:.1f} KiB",
            target="<= 20 KB",
            met=f["bytes_per_poll"] <= 20_000,
        )
    )
    results.add(
        Figure(
            section,
            "deployment placed -> in its agent's hands",
            f"max {ms(f['deploy_max'])}",
            target="< 1 s",
            met=f["deploy_max"] < 1.0,
        )
    )
    dropped = f.get("drop_after_last_beat")
    results.add(
        Figure(
            section,
            f"{agents // 10:,} agents killed at once: out of eligibility after their last contact",
            f"{dropped:.1f} s; other agents flapping: {f['flaps']}" if dropped else "never",
            target="<= stale_after_seconds (45) + one check (1 s), no flap",
            met=dropped is not None and dropped <= 46.5 and f["flaps"] == 0,
        )
    )
    results.add(
        Figure(
            section,
            "killed agents back: eligible again",
            f"{f['return_seconds']:.2f} s",
            target="within one heartbeat (15 s)",
            met=f["return_seconds"] <= 15,
        )
    )
    results.add(
        Figure(
            section,
            "reconnect storm: every agent holds its poll again after a restart",
            f"{f['storm_seconds']:.1f} s; eligibility meanwhile p99 {ms(f['storm_p99'] or 0)},"
            f" {f['storm_failures']} failed",
            target="< 60 s, eligibility answering",
            met=f["storm_seconds"] < 60 and f["storm_failures"] == 0,
        )
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=10000)
    parser.add_argument("--heartbeat", type=float, default=15.0, help="heartbeat interval, seconds")
    parser.add_argument("--stale", type=float, default=45.0, help="the service's stale_after_seconds")
    parser.add_argument("--flush", type=float, default=5.0, help="the service's heartbeat_flush_seconds")
    parser.add_argument("--churn", type=float, default=0.1, help="share of agents killed at once")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per agent")
    parser.add_argument("--poll-wait", type=float, default=30.0, help="the agents' long-poll wait")
    parser.add_argument("--window", type=float, default=10.0, help="seconds per measuring window")
    parser.add_argument("--rounds", type=int, default=2, help="quiet/loaded window pairs")
    parser.add_argument(
        "--settle",
        type=float,
        default=2.0,
        help="seconds after the polls held back in a quiet window renewed, before the next loaded window",
    )
    parser.add_argument("--deployments", type=int, default=20)
    parser.add_argument("--long-poll-max", type=int, default=0, help="0: agents + 100")
    parser.add_argument("--storm-limit", type=float, default=120.0)
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--postgres", action="store_true", help="two APIs and a worker on PostgreSQL instead")
    parser.add_argument("--procs", type=int, default=0, help="generator processes (0: one per 2,500 agents)")
    parser.add_argument(
        "--generator-nice",
        type=int,
        default=10,
        help="niceness of the generator processes (default 10: they stand in for other machines; 0: the service's)",
    )
    parser.add_argument("--worker", metavar="URL", help=argparse.SUPPRESS)  # a generator process
    parser.add_argument("--range", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        first, last = (int(part) for part in args.range.split(":"))
        asyncio.run(serve_commands(args.worker, first, last, args.heartbeat, args.poll_wait, args.gpus))
        return {}
    out: dict[str, Any] = {
        "agents": args.agents,
        "heartbeat": args.heartbeat,
        "stale": args.stale,
        "generator_nice": args.generator_nice,
    }
    asyncio.run(run_postgres_fleet(args, out) if args.postgres else run(args, out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
