"""The intake port (web/intake_listener.py): `POST /hooks/{source}` on threads of its own.

A registry gets the same answer there as on the main port, for every outcome (the two share
`web.webhook_judge`), and the same jobs; the port holds its own bounds against slow and greedy
clients (GPUBADGE_REQUEST_HEAD_TIMEOUT, GPUBADGE_MIN_BODY_RATE, GPUBADGE_MAX_BODY_BYTES,
GPUBADGE_INTAKE_MAX_CONNECTIONS) while it goes on serving everyone else. Here the listener runs
beside a real app in this process, so each test sees the store and the metrics; the wiring in
`gpubadge serve` (its port, its errors) is run as a child process. The answer's pace under a push
burst, from a real registry, is tests/test_push_burst.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
import pytest
from aiohttp.test_utils import TestServer

from fixtures.registry import free_port
from store import queries
from store.models import EnqueueBatch
from store.postgres_intake import enqueue_plan
from web.app import create_app
from web.commands import load_settings, serve_parser
from web.intake_listener import IntakeListener
from web.settings import ServiceSettings
from web.state import Services, services_of_app

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "webhooks"
V2 = {"Content-Type": "application/vnd.docker.distribution.events.v2+json"}
WAIT = 10.0  # seconds any one answer may take here


@dataclass
class Ports:
    main: str
    intake: str
    intake_port: int
    services: Services
    session: aiohttp.ClientSession
    listener: IntakeListener

    async def post(self, base: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, Any, Any]:
        async with self.session.post(f"{base}{path}", data=body, headers=headers) as reply:
            return reply.status, await reply.json(content_type=None), reply.headers


@contextlib.asynccontextmanager
async def ports(tmp_path: Path, **settings: Any) -> AsyncIterator[Ports]:
    """The app on a test server (the main port) and the intake port beside it, on one store."""
    config = ServiceSettings(db=tmp_path / "intake.db", **settings)
    app = create_app(config, start_workers=False)
    server = TestServer(app)
    await server.start_server()
    listener = IntakeListener(config)
    listener.bind("127.0.0.1", 0)
    listener.start(services_of_app(app))
    port = listener.ports[0]
    try:
        timeout = aiohttp.ClientTimeout(total=WAIT)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            yield Ports(
                str(server.make_url("")).rstrip("/"),
                f"http://127.0.0.1:{port}",
                port,
                services_of_app(app),
                session,
                listener,
            )
    finally:
        await asyncio.to_thread(listener.close)
        await server.close()


def fixture(name: str) -> bytes:
    return (FIXTURES / f"{name}.json").read_bytes()


def foreign_push() -> bytes:
    event = json.loads(fixture("distribution_push_v2"))
    for item in event["events"]:
        item["request"]["host"] = "registry.evil.example"
    return json.dumps(event).encode()


def many_pushes(count: int) -> bytes:
    event = json.loads(fixture("distribution_push_v2"))
    first = event["events"][0]
    event["events"] = [{**first, "target": {**first["target"], "tag": f"t{n}"}} for n in range(count)]
    return json.dumps(event).encode()


# (case, path, body, headers, settings): each delivered to both ports, which must answer alike
CASES: list[tuple[str, str, bytes, dict[str, str], dict[str, Any]]] = [
    ("push", "/hooks/distribution", fixture("distribution_push_v2"), V2, {}),
    ("delete", "/hooks/distribution", fixture("distribution_delete"), V2, {}),
    ("harbor", "/hooks/harbor", fixture("harbor_push_default"), {"Content-Type": "application/json"}, {}),
    ("unknown source", "/hooks/nexus", b"{}", {}, {}),
    ("no secret for acr", "/hooks/acr", b"{}", {}, {}),
    (
        "wrong secret",
        "/hooks/distribution?token=nope",
        fixture("distribution_push_v2"),
        V2,
        {"webhook_secret": "s3cret"},
    ),
    (
        "right secret",
        "/hooks/distribution?token=s3cret",
        fixture("distribution_push_v2"),
        V2,
        {"webhook_secret": "s3cret"},
    ),
    ("malformed", "/hooks/distribution", b"{not json", V2, {}),
    ("off the allowlist", "/hooks/distribution", foreign_push(), V2, {}),
    ("too many scans", "/hooks/distribution", many_pushes(5), V2, {"max_scans_per_delivery": 4}),
    ("too large", "/hooks/distribution", b"x" * 5000, V2, {"max_body_bytes": 4096}),
    ("queue full", "/hooks/distribution", many_pushes(3), V2, {"max_queued_scans": 2}),
]


@pytest.mark.parametrize(
    ("case", "path", "body", "headers", "settings"), CASES, ids=[case[0] for case in CASES]
)
async def test_the_intake_port_answers_every_delivery_as_the_main_port_does(
    tmp_path: Path, case: str, path: str, body: bytes, headers: dict[str, str], settings: dict[str, Any]
) -> None:
    async with ports(tmp_path, **settings) as at:
        intake = await at.post(at.intake, path, body, headers)
        main = await at.post(at.main, path, body, headers)
        assert (intake[0], without_ids(intake[1])) == (main[0], without_ids(main[1])), case
        assert intake[2].get("Retry-After") == main[2].get("Retry-After")
        if intake[0] == 202 and intake[1]["accepted"]:  # the jobs coalesce: each id names the same scan
            named = [
                await at.services.store.run(queries.job, job_id)
                for job_id in intake[1]["jobs"] + main[1]["jobs"]
            ]
            assert all(job is not None for job in named) and len({job.reference for job in named if job}) == 1
        label = path.split("/")[2].split("?")[0]
        label = label if label != "nexus" else "unknown"
        # counted once per port; the intake port tells the loop just after its answer
        await until_counted(at, f'gpubadge_webhooks_total{{source="{label}",status="{intake[0]}"}} 2.0')


def without_ids(answer: Any) -> Any:
    """An answer with its job ids counted, not named (a job moving meanwhile gets an alias id)."""
    return (
        {**answer, "jobs": len(answer["jobs"])} if isinstance(answer, dict) and "jobs" in answer else answer
    )


async def until_counted(at: Ports, line: str) -> None:
    """Until /metrics shows `line` (bounded by WAIT)."""
    deadline = asyncio.get_running_loop().time() + WAIT
    while True:
        async with at.session.get(f"{at.main}/metrics") as reply:
            exposition = await reply.text()
        if line in exposition.splitlines():
            return
        assert asyncio.get_running_loop().time() < deadline, f"{line} not in /metrics:\n{exposition}"
        await asyncio.sleep(0.01)


async def test_jobs_from_the_intake_port_are_committed_before_the_answer_and_wake_the_workers(
    tmp_path: Path,
) -> None:
    async with ports(tmp_path) as at:
        status, body, _ = await at.post(at.intake, "/hooks/distribution", many_pushes(3), V2)
        assert status == 202 and body["accepted"] == 3 and len(body["jobs"]) == 3
        store = at.services.store
        jobs = [await store.run(queries.job, job_id) for job_id in body["jobs"]]
        assert all(job is not None and job.state == "queued" for job in jobs), jobs


async def raw_exchange(
    port: int, data: bytes, *, answers: int = 1
) -> list[tuple[int, dict[str, str], bytes]]:
    """Send `data` on one connection; read `answers` whole answers (status, headers, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return [await asyncio.wait_for(read_answer(reader), WAIT) for _ in range(answers)]
    finally:
        writer.close()


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(head[0].split()[1])
    headers = {line.split(":", 1)[0].lower(): line.split(":", 1)[1].strip() for line in head[1:] if line}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, body


def post_bytes(body: bytes, *, path: str = "/hooks/distribution", extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


async def _scan_named(at: Ports, job_id: str) -> str:
    """The id of the job `job_id` names, once the intake's mover has carried it into the store."""
    deadline = asyncio.get_running_loop().time() + WAIT
    while True:
        async with at.session.get(f"{at.main}/api/scans/{job_id}") as reply:
            if reply.status == 200:
                return str((await reply.json())["id"])
        assert asyncio.get_running_loop().time() < deadline, f"{job_id} never reached the store"
        await asyncio.sleep(0.05)


async def test_keep_alive_pipelined_chunked_and_expect_continue_requests_are_served(tmp_path: Path) -> None:
    push = fixture("distribution_push_v2")
    chunked = (
        b"POST /hooks/distribution HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (push[:100], push[100:]))
        + b"0\r\n\r\n"
    )
    async with ports(tmp_path) as at:
        pipelined = await raw_exchange(at.intake_port, post_bytes(push) * 2 + chunked, answers=3)
        assert [status for status, _, _ in pipelined] == [202, 202, 202]
        # one image, one scan: the three answers name it (a delivery that came while the first one's row was
        # moving into the store names an alias of that job, which the store reads through)
        named = {json.loads(body)["jobs"][0] for _, _, body in pipelined}
        assert len(named) <= 2, named
        assert len({await _scan_named(at, job_id) for job_id in named}) == 1, named

        reader, writer = await asyncio.open_connection("127.0.0.1", at.intake_port)
        try:
            head = post_bytes(b"", extra="Expect: 100-continue\r\n").replace(
                b"Content-Length: 0", b"Content-Length: %d" % len(push)
            )
            writer.write(head)
            continued = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
            assert continued.startswith(b"HTTP/1.1 100 ")
            writer.write(push)
            status, _, _ = await asyncio.wait_for(read_answer(reader), WAIT)
            assert status == 202
        finally:
            writer.close()


async def test_bad_http_is_answered_and_closed(tmp_path: Path) -> None:
    async with ports(tmp_path) as at:
        ((garbage, _, _),) = await raw_exchange(at.intake_port, b"NOT HTTP AT ALL\r\n\r\n")
        assert garbage == 400
        ((other, _, body),) = await raw_exchange(
            at.intake_port, b"GET /api/images HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        assert other == 404 and b"POST /hooks/{source} only" in body
        ((method, _, _),) = await raw_exchange(
            at.intake_port, b"GET /hooks/harbor HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        assert method == 405
        huge = b"POST /hooks/harbor HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 40_000 + b"\r\n\r\n"
        ((too_big, _, _),) = await raw_exchange(at.intake_port, huge)
        assert too_big == 431


async def test_slow_clients_get_408_and_never_hold_up_a_registry(tmp_path: Path) -> None:
    """A head trickling in, and a body slower than GPUBADGE_MIN_BODY_RATE, each hold a buffer, not a
    thread: with every thread's worth of them open (and more), a delivery is answered at once."""
    timeout = 1.0
    async with ports(tmp_path, request_head_timeout=timeout, min_body_rate=1000, intake_threads=2) as at:
        loop = asyncio.get_running_loop()
        slow: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        for _ in range(3):
            slow.append(await asyncio.open_connection("127.0.0.1", at.intake_port))
            slow[-1][1].write(b"POST /hooks/distribution HTTP/1.1\r\nHost: x\r\n")  # a head, never ended
        body_slow = await asyncio.open_connection("127.0.0.1", at.intake_port)
        body_slow[1].write(post_bytes(b"{" * 100_000)[: -100_000 + 10])  # a head, then 10 bytes of 100 kB
        started = loop.time()
        status, _, _ = await at.post(at.intake, "/hooks/distribution", fixture("distribution_push_v2"), V2)
        assert status == 202 and loop.time() - started < 0.5
        for reader, writer in [*slow, body_slow]:
            answer = await asyncio.wait_for(reader.read(), timeout * 3 + 1)  # the answer, then closed
            assert answer.startswith(b"HTTP/1.1 408 "), answer[:80]
            writer.close()
        assert loop.time() - started < timeout * 3 + 1


async def test_connections_past_the_cap_are_answered_503_and_closed(tmp_path: Path) -> None:
    async with ports(tmp_path, intake_max_connections=3) as at:
        held = [await asyncio.open_connection("127.0.0.1", at.intake_port) for _ in range(3)]
        ((status, headers, body),) = await raw_exchange(at.intake_port, post_bytes(b"{}"))
        assert status == 503 and headers["retry-after"] and b"GPUBADGE_INTAKE_MAX_CONNECTIONS" in body
        for _, writer in held:
            writer.close()
        for _ in range(int(WAIT * 10)):  # the closes reach the leader: room again
            ((status, _, _),) = await raw_exchange(
                at.intake_port, post_bytes(fixture("distribution_push_v2"))
            )
            if status == 202:
                break
            await asyncio.sleep(0.1)
        assert status == 202


def run_serve(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpubadge.cli", "serve", "--db", str(tmp_path / "x.db")],
        env={**__import__("os").environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_serve_on_a_taken_intake_port_says_so_in_one_line(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        started = time.monotonic()
        done = run_serve(tmp_path, {"GPUBADGE_PORT": str(free_port()), "GPUBADGE_INTAKE_PORT": str(taken)})
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"the intake port: port {taken}" in done.stderr and "GPUBADGE_INTAKE_PORT" in done.stderr
    assert time.monotonic() - started < 20


def test_the_intake_port_needs_a_port_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """As `serve` loads its settings (a ValueError there is its exit 2, tests/test_config_file.py)."""
    with pytest.raises(ValueError, match="intake_port and port are both 9000"):
        load_settings(None, port=9000, intake_port=9000)  # --port and --intake-port
    monkeypatch.setenv("GPUBADGE_INTAKE_PORT", "9000")
    with pytest.raises(ValueError, match="intake_port and port are both 9000"):
        load_settings(None, port=9000)
    monkeypatch.setenv("GPUBADGE_INTAKE_PORT", "0")  # no intake port: nothing to collide with
    assert load_settings(None, port=9000).intake_port == 0
    assert ServiceSettings.model_fields["intake_port"].default == 8081  # beside the API's 8080
    assert serve_parser().parse_args(["--intake-port", "9001"]).intake_port == 9001


async def test_a_deletion_waiting_for_the_stores_writer_holds_one_thread_while_the_others_answer(
    tmp_path: Path,
) -> None:
    """A deletion writes the store itself, and waits while a scan (here: a held transaction) has its
    writer; the lead is handed on first, so a push on another connection is answered meanwhile from the
    intake's journal, which no scan writes."""
    async with ports(tmp_path, sqlite_busy_timeout=30) as at:
        holder = sqlite3.connect(tmp_path / "intake.db", isolation_level=None, check_same_thread=False)
        holder.execute("BEGIN IMMEDIATE")  # the store's writer, as a scan's batch takes it
        try:
            deletion = asyncio.create_task(
                at.post(at.intake, "/hooks/distribution", fixture("distribution_delete"), V2)
            )
            deadline = asyncio.get_running_loop().time() + WAIT
            while not any(connection.serving for connection in list(at.listener._open)):  # being served
                assert asyncio.get_running_loop().time() < deadline, "the deletion was never read"
                await asyncio.sleep(0.01)
            status, body, _ = await at.post(
                at.intake, "/hooks/distribution", fixture("distribution_push_v2"), V2
            )
            assert status == 202 and body["accepted"] == 1
            assert not deletion.done()  # still waiting for the writer
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        status, body, _ = await asyncio.wait_for(deletion, WAIT)
        assert status == 202 and body["deleted"] == 2


async def test_the_intake_port_commits_on_postgresql(tmp_path: Path, postgres_url: str) -> None:
    async with ports(tmp_path, database_url=postgres_url) as at:
        status, body, _ = await at.post(at.intake, "/hooks/distribution", many_pushes(3), V2)
        assert status == 202 and len(body["jobs"]) == 3
        jobs = [await at.services.store.run(queries.job, job_id) for job_id in body["jobs"]]
        assert all(job is not None and job.state == "queued" for job in jobs), jobs
        again = await at.post(at.main, "/hooks/distribution", many_pushes(3), V2)
        assert again[0] == 202 and sorted(again[1]["jobs"]) == sorted(body["jobs"])  # coalesced


def tagged_push(tag: str) -> bytes:
    event = json.loads(fixture("distribution_push_v2"))
    event["events"] = [{**item, "target": {**item["target"], "tag": tag}} for item in event["events"]]
    return json.dumps(event).encode()


async def test_one_registrys_deliveries_on_postgresql_are_served_by_one_thread(
    tmp_path: Path, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one connection open, the thread that reads a delivery keeps the lead through
    PostgreSQL's round trip: no second thread is woken only to wait on the selector."""
    async with ports(tmp_path, database_url=postgres_url) as at:
        committers: list[int] = []
        enqueue_here = at.services.intake.enqueue_here

        def counted(*args: Any, **kwargs: Any) -> list[str]:
            committers.append(threading.get_ident())
            return enqueue_here(*args, **kwargs)

        monkeypatch.setattr(at.services.intake, "enqueue_here", counted)
        for n in range(12):
            status, body, _ = await at.post(at.intake, "/hooks/distribution", tagged_push(f"t{n}"), V2)
            assert status == 202 and len(body["jobs"]) == 1
        assert len(at.listener._open) == 1  # one kept-alive connection served them all
        assert len(set(committers)) == 1, committers


async def test_a_postgresql_commit_that_waits_hands_the_lead_to_another_open_connection(
    tmp_path: Path, postgres_url: str
) -> None:
    """A delivery whose commit waits on PostgreSQL (here a row lock: another transaction queued the same
    reference and has not committed) holds its thread; with another connection open the lead was handed
    on first, so that connection's push is answered meanwhile."""
    async with ports(tmp_path, database_url=postgres_url) as at:
        timeout = aiohttp.ClientTimeout(total=WAIT)
        async with aiohttp.ClientSession(timeout=timeout) as other:
            async with other.post(
                f"{at.intake}/hooks/distribution", data=tagged_push("t0"), headers=V2
            ) as reply:
                assert reply.status == 202  # the other connection, open and idle now
                first_job = (await reply.json())["jobs"][0]
            job = await at.services.store.run(queries.job, first_job)
            assert job is not None and ":t0@" in job.reference
            blocked = job.reference.replace(":t0@", ":blocked@")
            holder = await psycopg.AsyncConnection.connect(postgres_url)
            try:
                plan = enqueue_plan([EnqueueBatch([(blocked, job.registry)], "test", 3)])
                await holder.execute(*next(plan))  # its row inserted, uncommitted: the unique key waits
                waiting = asyncio.create_task(
                    at.post(at.intake, "/hooks/distribution", tagged_push("blocked"), V2)
                )
                deadline = asyncio.get_running_loop().time() + WAIT
                while not any(connection.serving for connection in list(at.listener._open)):
                    assert asyncio.get_running_loop().time() < deadline, "the delivery was never read"
                    await asyncio.sleep(0.01)
                async with other.post(
                    f"{at.intake}/hooks/distribution", data=tagged_push("t1"), headers=V2
                ) as reply:
                    assert reply.status == 202 and len((await reply.json())["jobs"]) == 1
                assert not waiting.done()  # still waiting for the row lock
            finally:
                await holder.rollback()
                await holder.close()
            status, body, _ = await asyncio.wait_for(waiting, WAIT)
            assert status == 202 and len(body["jobs"]) == 1


async def test_a_postgresql_commit_held_past_the_store_timeout_is_answered_503(
    tmp_path: Path, postgres_url: str
) -> None:
    """The intake port's commit is bounded as the main port's is: a row lock held past the store's
    timeout (here 1 s) gets the sender a 503 with Retry-After, and its retry, once the lock is gone, a 202."""
    async with ports(tmp_path, database_url=postgres_url, sqlite_busy_timeout=1) as at:
        status, body, _ = await at.post(at.intake, "/hooks/distribution", tagged_push("t0"), V2)
        assert status == 202
        job = await at.services.store.run(queries.job, body["jobs"][0])
        assert job is not None and ":t0@" in job.reference
        holder = await psycopg.AsyncConnection.connect(postgres_url)
        try:
            plan = enqueue_plan(
                [EnqueueBatch([(job.reference.replace(":t0@", ":held@"), job.registry)], "test", 3)]
            )
            await holder.execute(*next(plan))  # uncommitted: the intake's insert of that key waits on it
            started = time.monotonic()
            status, body, headers = await at.post(at.intake, "/hooks/distribution", tagged_push("held"), V2)
            waited = time.monotonic() - started
            assert status == 503 and "within 1 s" in body["error"], body
            assert headers["Retry-After"] and 0.9 < waited < WAIT, waited
        finally:
            await holder.rollback()
            await holder.close()
        status, body, _ = await at.post(at.intake, "/hooks/distribution", tagged_push("held"), V2)
        assert status == 202 and len(body["jobs"]) == 1
