"""Shared test fixtures: one real registry per session, and a pusher that uses skopeo."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.busybox import busybox_unavailable_reason
from fixtures.dockerd import LocalDockerd, dockerd_unavailable_reason, run_dockerd
from fixtures.oci import ImageSpec, push_image
from fixtures.postgres import LocalPostgres, postgres_unavailable_reason, run_postgres
from fixtures.registry import LocalRegistry, run_registry

Pusher = Callable[[ImageSpec | list[ImageSpec], str], str]
# Set by `make test`, which installs Docker first: a Docker engine that cannot start is then a
# failure, not a skip, so a broken CI host cannot pass by skipping every agent test.
REQUIRE_DOCKER_ENV = "GPUBADGE_REQUIRE_DOCKER"
# The same promise for the rest of what `make deps-system` installs (PostgreSQL, gcc): a test that
# needs one of them fails, naming what is missing, instead of skipping quietly.
REQUIRE_SYSTEM_ENV = "GPUBADGE_REQUIRE_SYSTEM"
# A `gpubadge serve` a test starts itself has no intake port unless it asks for one (the default,
# 8081, is one port for the whole host): `fixtures.service.run_service_process` gives each service a
# free one, and tests/test_intake_port.py runs the default.
os.environ.setdefault("GPUBADGE_INTAKE_PORT", "0")


def _set(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def docker_required() -> bool:
    return _set(REQUIRE_DOCKER_ENV)


def skip_unless_required(reason: str) -> None:
    """Skip for `reason` (a Debian package missing here), or fail when `make test` promised it."""
    if _set(REQUIRE_SYSTEM_ENV):
        pytest.fail(f"{REQUIRE_SYSTEM_ENV} is set (make test installs it), but {reason}", pytrace=False)
    pytest.skip(reason)


# The modules that read NVIDIA's wheels and the GPU packages' members from PyPI (cached under
# ~/.cache/gpubadge/test-wheels, tests/nvidia_wheels.py): when any of them runs, `tests/prefetch.py`
# fills that cache beside the suite.
PREFETCHED_MODULES = {
    "test_carried_cuda",
    "test_deep_scan",
    "test_fatbin",
    "test_gpu_dispatch",
    "test_gpu_modules",
    "test_gpu_packages",
    "test_inferred",
    "test_nvcc_programs",
}
_PREFETCH: list[subprocess.Popen[bytes]] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the cache's prefetch (`python -m tests.prefetch`, lowest priority) when the session will
    run a test that reads PyPI's wheels, unless GPUBADGE_PREFETCH=0. Under pytest-xdist every worker
    collects the whole suite, and the first worker alone starts it."""
    if os.environ.get("GPUBADGE_PREFETCH", "1") == "0" or session.config.option.collectonly:
        return
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        return
    if any(
        item.module is not None and item.module.__name__.rpartition(".")[2] in PREFETCHED_MODULES
        for item in session.items
        if isinstance(item, pytest.Function)
    ):
        root = Path(__file__).resolve().parent.parent
        _PREFETCH.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.prefetch"],
                cwd=root,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A prefetch still running when the tests are done is stopped (each entry it writes is whole
    or absent: written aside, then renamed)."""
    for process in _PREFETCH:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="session")
def registry() -> Iterator[LocalRegistry]:
    """A real CNCF Distribution registry on a free loopback port, shared by the session."""
    with run_registry() as running:
        yield running


@pytest.fixture(scope="session")
def push(registry: LocalRegistry, tmp_path_factory: pytest.TempPathFactory) -> Pusher:
    """push(spec_or_specs, "repo:tag") -> digest. Pushes with skopeo, never with our code."""
    counter = itertools.count()

    def _push(spec: ImageSpec | list[ImageSpec], name: str) -> str:
        workdir: Path = tmp_path_factory.mktemp(f"layout{next(counter)}")
        return push_image(spec, f"{registry.host}/{name}", workdir)

    return _push


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[LocalPostgres]:
    """One real PostgreSQL (Debian's, initdb into a temp dir, as `postgres`) for the session."""
    reason = postgres_unavailable_reason()
    if reason:
        skip_unless_required(reason)
    with run_postgres() as server:
        yield server


@pytest.fixture
def postgres_url(postgres_server: LocalPostgres) -> Iterator[str]:
    """A fresh, empty database on the session's server for one test; dropped afterwards."""
    name = f"t{next(_DATABASE_NUMBERS)}"
    url = postgres_server.create_database(name)
    try:
        yield url
    finally:
        postgres_server.drop_database(name)


_DATABASE_NUMBERS = itertools.count()

OpenBackend = Callable[[], Any]


@pytest.fixture(params=["sqlite", "postgres"])
def open_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OpenBackend]:
    """open_backend() -> a store backend on this test's database; each call opens it again, as
    another process would. Parametrised: every test using it runs on SQLite and on PostgreSQL."""
    opened: list[Any] = []
    if request.param == "sqlite":
        from store.sqlite import SqliteStore

        def open_sqlite() -> Any:
            opened.append(SqliteStore(tmp_path / "store.db"))
            return opened[-1]

        opener: OpenBackend = open_sqlite
    else:
        from store.postgres import PostgresStore

        url = request.getfixturevalue("postgres_url")

        def open_postgres() -> Any:
            opened.append(PostgresStore(url, pool_size=4))
            return opened[-1]

        opener = open_postgres
    try:
        yield opener
    finally:
        for backend in opened:
            backend.close()


@pytest.fixture(scope="session")
def dockerd() -> Iterator[LocalDockerd]:
    """One private dockerd (stand-in `nvidia` runtime) for every Docker test: vfs makes starts slow."""
    reason = dockerd_unavailable_reason() or busybox_unavailable_reason()
    if reason and docker_required():
        pytest.fail(f"{REQUIRE_DOCKER_ENV} is set (make test installs Docker), but {reason}", pytrace=False)
    if reason:
        pytest.skip(reason)
    with run_dockerd() as daemon:
        yield daemon


# Debian's chromium, driven by Playwright; never `playwright install`. No network, no sandbox (root).
BROWSER_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless Chromium per test module (the sync API must not outlive the module's sync tests)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=BROWSER_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()
