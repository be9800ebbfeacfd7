"""Can one client lock the others out? Issue 43's service-side attacks against a real `gpubadge serve`.

    python3 -m bench.lockout_bench [--tree DIR] [--json]

`--tree` runs the service from another checkout (e.g. `git archive <commit> | tar -x -C DIR`), so one
run compares the code before and after side by side; the attacks and the measures are this file's.
Each attack comes from 127.0.0.2; the callers that must get through from 127.0.0.1.

- **long polls**: `GPUBADGE_MAX_CONNECTIONS=200`, 200 public `GET /api/images/by-ref?wait=60` held;
  then 20 rounds of /healthz, an agent heartbeat (with its token) and an admission review: answered
  200 or not, and how fast.
- **tls**: a process allowed 512 open files, 700 connections to the admission port that never send a
  ClientHello; /healthz polled every 0.1 s for 15 s: how many answered 200, the longest time without
  one, and how much the log grew.
- **registrations**: 150 registrations of 5,000 fake GPUs each (1 MB, under the body limit) from the
  fleet-wide token: the service's RSS before and after, and what the requests were answered.
- **cost**: 3,000 sequential keep-alive `GET /api/openapi.json` with nothing else going on: the p50 and
  p99 of each (what the guard and the reserve add to an ordinary request).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp

from fixtures.admission import pod_admission_review
from fixtures.registry import free_port
from fixtures.service import wait_healthy
from fixtures.tls import self_signed_certificate

ATTACKER = "127.0.0.2"
TOKEN = "lockout-bench-token"


@contextmanager
def serve(
    tree: Path, workdir: Path, env: dict[str, str], wrapper: tuple[str, ...] = ()
) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    port = free_port()
    log = workdir / f"serve-{port}.log"
    full = {
        **{key: value for key, value in os.environ.items() if not key.startswith("GPUBADGE_")},
        "PYTHONPATH": str(tree),
        "GPUBADGE_DB": str(workdir / f"{port}.db"),
        "GPUBADGE_PORT": str(port),
        "GPUBADGE_WORKERS": "0",
        **env,
    }
    with log.open("ab") as out:
        process = subprocess.Popen(
            [*wrapper, sys.executable, "-m", "gpubadge.cli", "serve", "--log-level", "WARNING"],
            env=full,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tree,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, timeout=120)
        yield url, process, log
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


async def _open(port: int, count: int, send: bytes = b"") -> list[asyncio.StreamWriter]:
    writers = []
    for _ in range(count):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(ATTACKER, 0))
        except OSError:
            continue
        if send:
            writer.write(send)
        writers.append(writer)
    return writers


async def _timed(session: aiohttp.ClientSession, method: str, url: str, **kwargs: Any) -> tuple[int, float]:
    started = time.perf_counter()
    try:
        async with session.request(method, url, timeout=aiohttp.ClientTimeout(total=10), **kwargs) as reply:
            await reply.read()
            return reply.status, time.perf_counter() - started
    except (aiohttp.ClientError, TimeoutError):
        return 0, time.perf_counter() - started


async def long_polls(tree: Path, workdir: Path) -> dict[str, Any]:
    env = {
        "GPUBADGE_MAX_CONNECTIONS": "200",
        "GPUBADGE_AGENT_TOKEN": TOKEN,
        "GPUBADGE_REQUEST_HEAD_TIMEOUT": "60",
    }
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    with serve(tree, workdir, env) as (url, _, _):
        port = int(url.rsplit(":", 1)[1])
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
            await _timed(
                session, "POST", f"{url}/api/servers", json={"name": "gpu-1", "gpus": []}, headers=bearer
            )
            poll = b"GET /api/images/by-ref?ref=127.0.0.1:9/never:1&wait=60 HTTP/1.1\r\nHost: x\r\n\r\n"
            held = await _open(port, 200, poll)
            await asyncio.sleep(2.0)
            answers: dict[str, list[tuple[int, float]]] = {"healthz": [], "heartbeat": [], "admission": []}
            review = pod_admission_review(["registry.example/app:1"])
            for _ in range(20):
                answers["healthz"].append(await _timed(session, "GET", f"{url}/healthz"))
                answers["heartbeat"].append(
                    await _timed(
                        session, "POST", f"{url}/api/servers/gpu-1/heartbeat", json={}, headers=bearer
                    )
                )
                answers["admission"].append(await _timed(session, "POST", f"{url}/k8s/admit", json=review))
            for writer in held:
                writer.close()
    return {
        kind: {
            "ok": sum(status == 200 for status, _ in results),
            "of": len(results),
            "p50_ms": round(statistics.median(seconds for _, seconds in results) * 1000, 1),
            "max_ms": round(max(seconds for _, seconds in results) * 1000, 1),
        }
        for kind, results in answers.items()
    }


async def tls(tree: Path, workdir: Path) -> dict[str, Any]:
    cert, key = self_signed_certificate(workdir)
    tls_port = free_port()
    env = {
        "GPUBADGE_ADMISSION_TLS_PORT": str(tls_port),
        "GPUBADGE_ADMISSION_TLS_CERT": str(cert),
        "GPUBADGE_ADMISSION_TLS_KEY": str(key),
    }
    with serve(tree, workdir, env, ("prlimit", "--nofile=512:512")) as (url, _, log):
        before = log.stat().st_size
        stalled = await _open(tls_port, 700)
        answered, gap, last_ok = 0, 0.0, time.monotonic()
        started = time.monotonic()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
            while time.monotonic() - started < 15.0:
                status, _ = await _timed(session, "GET", f"{url}/healthz")
                now = time.monotonic()
                if status == 200:
                    answered += 1
                    last_ok = now
                gap = max(gap, now - last_ok)
                await asyncio.sleep(0.1)
        for writer in stalled:
            writer.close()
        await asyncio.sleep(1.0)
        grown = log.stat().st_size - before
    return {
        "stalled": len(stalled),
        "healthz_ok": answered,
        "longest_without_ok_s": round(gap, 1),
        "log_bytes": grown,
    }


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def registrations(tree: Path, workdir: Path) -> dict[str, Any]:
    gpu = {"name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559, "compute_capability": "9.0"}
    with serve(tree, workdir, {"GPUBADGE_AGENT_TOKEN": TOKEN}) as (url, process, _):
        before = _rss_mib(process.pid)
        answers: dict[int, int] = {}
        for number in range(150):
            body = {
                "name": f"fake-{number}",
                "gpus": [
                    {**gpu, "index": i, "uuid": f"GPU-{number}-{i:06d}-aaaa-bbbb-cccc"} for i in range(5000)
                ],
            }
            request = urllib.request.Request(
                f"{url}/api/servers",
                data=json.dumps(body).encode(),
                method="POST",
                headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=120) as reply:
                    status = reply.status
            except urllib.error.HTTPError as exc:
                status = exc.code
            answers[status] = answers.get(status, 0) + 1
        after = _rss_mib(process.pid)
    return {"rss_before_mib": round(before), "rss_after_mib": round(after), "answers": answers}


async def cost(tree: Path, workdir: Path) -> dict[str, Any]:
    with serve(tree, workdir, {}) as (url, _, _):
        async with aiohttp.ClientSession() as session:
            for _ in range(200):  # warm
                await _timed(session, "GET", f"{url}/api/openapi.json")
            times = sorted(
                [(await _timed(session, "GET", f"{url}/api/openapi.json"))[1] for _ in range(3000)]
            )
    return {
        "p50_ms": round(times[len(times) // 2] * 1000, 3),
        "p99_ms": round(times[int(len(times) * 0.99)] * 1000, 3),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="bench.lockout_bench")
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--only", choices=["long_polls", "tls", "registrations", "cost"], action="append")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    chosen = args.only or ["long_polls", "tls", "registrations", "cost"]
    figures: dict[str, Any] = {"tree": str(args.tree)}
    with tempfile.TemporaryDirectory(prefix="gpubadge-lockout-") as directory:
        workdir = Path(directory)
        for name in chosen:
            if name == "registrations":
                figures[name] = registrations(args.tree, workdir)
            else:
                figures[name] = asyncio.run(
                    {"long_polls": long_polls, "tls": tls, "cost": cost}[name](args.tree, workdir)
                )
            print(f"{name}: {json.dumps(figures[name])}", flush=True)
    if args.json:
        print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
