"""UI render time with 10,000 images in the store (target: every page < 100 ms).

The pages are served by the real aiohttp app over loopback HTTP; the store is
filled with reports directly (scanning 10,000 images is not what is measured).
Prints one line per page: median and p95 over repeated requests.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from scanner.models import GpuFacts, ImageReport, LibcVerdict, PlatformReport
from store import SqliteStore as Store
from store import queries
from web.app import create_app
from web.settings import ServiceSettings

PAGES = (
    "/",
    "/?gpu=gpu&libc=glibc",
    "/?cuda=12.3&registry=ghcr.io",
    "/?q=app99",
    "/?page=150",
    "/images/127.0.0.1:5000/team0/app0:latest",
    "/badge/127.0.0.1:5000/team0/app0/latest.svg",
    "/scans",
)
REQUIRE = "cuda>=12.2 brand=tesla,driver>=470,driver<471 brand=tesla,driver>=525,driver<526"


def fill(path: Path, count: int) -> None:
    store = Store(path)
    start = datetime(2026, 1, 1, tzinfo=UTC)
    for number in range(count):
        registry = ("127.0.0.1:5000", "ghcr.io", "docker.io")[number % 3]
        gpu = number % 4 == 0
        digest = f"sha256:{number:064x}"
        platform = PlatformReport(
            platform="linux/amd64",
            digest=digest,
            gpu=GpuFacts(
                required=gpu,
                cuda_version=f"12.{number % 6}" if gpu else None,
                requirements=[REQUIRE] if gpu else [],
                env={"NVIDIA_REQUIRE_CUDA": REQUIRE} if gpu else {},
            ),
            libc=LibcVerdict(flavour=("glibc", "musl", "none")[number % 3]),
            badges=["nvidia-gpu"] if gpu else [],
        )
        repository = f"team{number % 50}/app{number}"
        store.run(
            queries.save_report,
            ImageReport(
                reference=f"{registry}/{repository}:latest",
                digest=digest,
                registry=registry,
                repository=repository,
                tag="latest",
                platforms=[platform],
                scanned_at=start + timedelta(seconds=number),
            ),
        )
        store.run(queries.record_tag, registry, repository, "latest", digest)
    store.close()


async def measure(db: Path, rounds: int) -> dict[str, list[float]]:
    app = create_app(ServiceSettings(db=db, docker_config=None), start_workers=False)
    samples: dict[str, list[float]] = {page: [] for page in PAGES}
    async with TestClient(TestServer(app)) as client:
        for page in PAGES:
            for _ in range(rounds):
                started = time.perf_counter()
                response = await client.get(page)
                await response.read()
                samples[page].append((time.perf_counter() - started) * 1000)
                if response.status != 200:
                    raise RuntimeError(f"{page} answered {response.status}")
    return samples


def main(argv: list[str]) -> int:
    count = int(argv[0]) if argv else 10_000
    rounds = int(argv[1]) if len(argv) > 1 else 20
    with tempfile.TemporaryDirectory() as workdir:
        db = Path(workdir) / "ui.db"
        fill(db, count)
        samples = asyncio.run(measure(db, rounds))
    for page, values in samples.items():
        p95 = sorted(values)[max(0, int(len(values) * 0.95) - 1)]
        print(f"{page}: median {statistics.median(values):.1f} ms, p95 {p95:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
