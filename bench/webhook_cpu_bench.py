"""CPU per webhook delivery: what `gpubadge serve` spends to receive, authenticate, parse, enqueue,
commit and answer one Distribution notification.

The service runs as `gpubadge serve` in a child process with its SQLite store (WAL,
synchronous=NORMAL) and scan workers off, so the figure is the delivery path alone. A
webhook secret is configured, so every delivery is authenticated as in production. The
deliveries are Distribution notification envelopes, one push each, every one naming a new
image, posted over one keep-alive connection one at a time, each in one write, as the registry
sends them (it waits for each answer before the next). The service's CPU is read from /proc/<pid>/stat
(utime + stime, all threads) before and after the measured window; nothing is subtracted.
An idle window of the same length is measured too and reported beside it, so a reader can
see how little of the figure is background work (the worker-less service has none to speak of).

The peer, in the same run, is a null receiver: a separate aiohttp process (on the same event
loop as `serve`) that reads each body and answers 202 with a fixed JSON body, and does nothing
else. Its CPU per delivery is the floor any aiohttp receiver pays for the HTTP exchange alone;
the ratio says how much of gpubadge's figure is above that floor (authentication, parsing,
the allowlist, the commit and its hop to the intake thread).

Run alone: python3 -m bench.webhook_cpu_bench [--quick] [--deliveries N] [--senders N]
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bench.common import REPO_ROOT, Figure, Results, measure, ms, percentile, process_cpu_seconds
from bench.service_bench import count_jobs, distribution_event
from fixtures.process import stop_process
from fixtures.registry import free_port
from fixtures.service import run_service_process

SECRET = "bench-webhook-secret"
TARGET_MS = 0.5
REGISTRY_HOST = "127.0.0.1:5999"  # loopback: on the default allowlist; never contacted


@dataclass
class CpuFigures:
    deliveries: int = 10_000
    warmup: int = 500
    senders: int = 1

    @classmethod
    def quick(cls) -> CpuFigures:
        return cls(deliveries=2_000, warmup=200)


@dataclass
class CpuRun:
    deliveries: int
    senders: int
    cpu_s: float
    wall_s: float
    idle_cpu_s: float
    latencies: list[float]
    stored: int

    @property
    def per_delivery_ms(self) -> float:
        return self.cpu_s / self.deliveries * 1000


class Sender:
    """One keep-alive HTTP/1.1 connection that posts a delivery and reads its answer, as a registry does.

    Each request goes out in one write (Go's HTTP client buffers a small request whole), so the
    service reads each delivery in one piece, as it would from the registry. Deliberately lean,
    so the client takes little of the two shared cores from the service being measured.
    """

    def __init__(self, host: str, port: int, path: str, headers: dict[str, str]) -> None:
        self.socket = socket.create_connection((host, port))
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = self.socket.makefile("rb")
        fixed = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        self.head = f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n{fixed}".encode()

    def post(self, body: bytes) -> tuple[int, bytes]:
        self.socket.sendall(self.head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        status = int(self.reader.readline().split()[1])
        length = 0
        while (line := self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return status, self.reader.read(length)

    def close(self) -> None:
        self.reader.close()
        self.socket.close()


def post_all(url: str, bodies: list[bytes], senders: int) -> list[float]:
    """POST every body, `senders` connections at a time; each answer's latency (s).

    Anything but a 202 stops the run: a figure over refused deliveries would be meaningless.
    """
    parts = urllib.parse.urlsplit(url)
    headers = {
        "Content-Type": "application/vnd.docker.distribution.events.v1+json",
        "Authorization": f"Bearer {SECRET}",
        "User-Agent": "bench-registry-notifier",
    }
    latencies: list[float] = []
    pending = iter(bodies)
    lock = threading.Lock()

    def send() -> None:
        sender = Sender(parts.hostname or "127.0.0.1", parts.port or 80, parts.path, headers)
        try:
            while True:
                with lock:
                    body = next(pending, None)
                if body is None:
                    return
                started = time.perf_counter()
                status, answer = sender.post(body)
                if status != 202:
                    raise RuntimeError(f"webhook answered {status}: {answer[:300]!r}")
                latencies.append(time.perf_counter() - started)
        finally:
            sender.close()

    with ThreadPoolExecutor(senders) as pool:
        for future in [pool.submit(send) for _ in range(senders)]:
            future.result()
    return latencies


NULL_RECEIVER = """
import sys
from aiohttp import web
from jobs.event_loop import new_event_loop

async def receive(request):
    await request.read()
    return web.json_response({"accepted": 1, "deleted": 0, "jobs": ["0" * 32]}, status=202)

app = web.Application()
app.router.add_post("/hooks/{source}", receive)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None, loop=new_event_loop())
"""


def measure_null_receiver(figures: CpuFigures) -> float:
    """CPU seconds per delivery of the null receiver (see the module docstring), same deliveries."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", NULL_RECEIVER, str(port)], cwd=REPO_ROOT)
    try:
        url = f"http://127.0.0.1:{port}/hooks/distribution"
        deadline = time.monotonic() + 30
        while True:
            try:
                post_all(url, [distribution_event(REGISTRY_HOST, 0)], 1)
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise
                time.sleep(0.05)
        post_all(url, [distribution_event(REGISTRY_HOST, 50_000_000 + i) for i in range(figures.warmup)], 1)
        bodies = [distribution_event(REGISTRY_HOST, i) for i in range(figures.deliveries)]
        with measure(process.pid) as window:
            post_all(url, bodies, figures.senders)
        return window.watched_cpu_s / figures.deliveries
    finally:
        stop_process(process, grace=5)


def measure_cpu(figures: CpuFigures, workdir: Path) -> CpuRun:
    db = workdir / "webhook-cpu.db"
    env = {"GPUBADGE_WORKERS": "0", "GPUBADGE_WEBHOOK_SECRET": SECRET}
    warmup = [distribution_event(REGISTRY_HOST, 50_000_000 + i) for i in range(figures.warmup)]
    bodies = [distribution_event(REGISTRY_HOST, i) for i in range(figures.deliveries)]
    with run_service_process(db, env=env) as service:
        assert service.process is not None
        pid = service.process.pid
        url = f"{service.url}/hooks/distribution"
        post_all(url, warmup, figures.senders)
        with measure(pid) as window:
            latencies = post_all(url, bodies, figures.senders)
        idle_started = process_cpu_seconds(pid)
        time.sleep(min(window.wall_s, 10.0))
        idle = (process_cpu_seconds(pid) - idle_started) * window.wall_s / min(window.wall_s, 10.0)
    return CpuRun(
        deliveries=figures.deliveries,
        senders=figures.senders,
        cpu_s=window.watched_cpu_s,
        wall_s=window.wall_s,
        idle_cpu_s=idle,
        latencies=latencies,
        stored=count_jobs(db) - figures.warmup,
    )


def run_all(results: Results, quick: bool, figures: CpuFigures | None = None) -> None:
    figures = figures or (CpuFigures.quick() if quick else CpuFigures())
    print(
        f"webhook CPU: {figures.deliveries} Distribution deliveries, {figures.senders} at a time",
        flush=True,
    )
    workdir = Path(tempfile.mkdtemp(prefix="gpubadge-bench-hookcpu-"))
    try:
        run = measure_cpu(figures, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    null_ms = measure_null_receiver(figures) * 1000
    per = run.per_delivery_ms
    results.add(
        Figure(
            "webhook-cpu",
            f"service CPU per Distribution delivery (authenticated, SQLite, {run.senders} at a time),"
            f" {run.deliveries:,} deliveries",
            f"{per:.3f} ms",
            peer=f"null aiohttp receiver: {null_ms:.3f} ms",
            ratio=null_ms / per if per > 0 else None,
            target=f"<= {TARGET_MS} ms",
            met=per <= TARGET_MS and run.stored == run.deliveries,
            note=f"service CPU {run.cpu_s:.2f} s over {run.wall_s:.1f} s wall; the idle service spends"
            f" {run.idle_cpu_s:.2f} s in as long (not subtracted); {run.stored} jobs committed;"
            f" 202 p50 {ms(percentile(run.latencies, 0.5))}, p99 {ms(percentile(run.latencies, 0.99))};"
            f" load average {' '.join(Path('/proc/loadavg').read_text().split()[:3])}",
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2,000 deliveries instead of 10,000")
    parser.add_argument("--deliveries", type=int, help="how many deliveries to measure")
    parser.add_argument("--senders", type=int, default=1, help="deliveries in flight at once")
    args = parser.parse_args()
    figures = CpuFigures.quick() if args.quick else CpuFigures()
    if args.deliveries:
        figures.deliveries = args.deliveries
    figures.senders = args.senders
    results = Results()
    run_all(results, args.quick, figures)
    for figure in results.figures:
        print(f"  peer: {figure.peer}; {figure.note}")


if __name__ == "__main__":
    main()
