"""`gpubadge export sqlite` and `GET /api/export.sqlite`, end to end.

Real images pushed by skopeo to a real registry, scanned by `gpubadge scan`, exported by
`gpubadge export sqlite` (a subprocess, as users run it), then opened by Datasette (from PyPI,
on a free loopback port) and by sqlite3. PostgreSQL is the real one of tests/conftest.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import pty
import re
import select
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from fixtures import catalog
from fixtures.process import stop_process
from fixtures.registry import LocalRegistry, free_port
from fixtures.service import run_service_process
from store import queries
from store.sqlite import SqliteStore
from tests.conftest import Pusher

GPU_IMAGES = ("exports/cuda-ubuntu:12.2", "exports/alpine-gpu:3.20")
CPU_IMAGE = "exports/plain-glibc:22.04"
LATER_IMAGE = "exports/static:1"
SPECS = {
    "exports/cuda-ubuntu:12.2": catalog.cuda_ubuntu(),
    "exports/alpine-gpu:3.20": catalog.alpine_gpu(),
    "exports/plain-glibc:22.04": catalog.plain_glibc(),
    "exports/static:1": catalog.static_scratch(),
}
LOOPBACK = ("-h", "127.0.0.1", "-p")
TABLES = ("images", "platforms", "env", "layers", "platform_layers", "servers")


@pytest.fixture(scope="module")
def refs(registry: LocalRegistry, push: Pusher) -> dict[str, str]:
    for name, spec in SPECS.items():
        push(spec, name)
    return {name: f"{registry.host}/{name}" for name in SPECS}


def gpubadge(
    *args: str, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpubadge.cli", *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def scan(db: Path, *references: str) -> None:
    done = gpubadge("scan", "--db", str(db), *references)
    assert done.returncode == 0, done.stderr


def export(out: Path, *args: str, db: Path | None = None, env: dict[str, str] | None = None) -> str:
    done = gpubadge("export", "sqlite", str(out), *(("--db", str(db)) if db else ()), *args, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # not a terminal: no progress bar
    return done.stdout


@pytest.fixture(scope="module")
def three(refs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite store holding two GPU images and one CPU image, scanned by `gpubadge scan`."""
    db = tmp_path_factory.mktemp("export-store") / "store.db"
    scan(db, *(refs[name] for name in (*GPU_IMAGES, CPU_IMAGE)))
    return db


def rows(path: Path, table: str) -> list[tuple[Any, ...]]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return sorted(conn.execute(f"SELECT * FROM {table}").fetchall(), key=repr)


def digest_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def datasette(database: Path, metadata: Path) -> Iterator[str]:
    """`datasette serve` on a free loopback port; its base URL once /-/versions.json answers (bounded)."""
    port = free_port()
    log = database.with_suffix(".datasette.log")
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "datasette",
                "serve",
                str(database),
                "-m",
                str(metadata),
                *LOOPBACK,
                str(port),
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, f"datasette exited: {log.read_text()}"
            assert time.monotonic() < deadline, f"datasette did not answer in 60 s: {log.read_text()}"
            try:
                with urllib.request.urlopen(f"{url}/-/versions.json", timeout=2):
                    break
            except OSError:
                time.sleep(0.1)
        yield url
    finally:
        stop_process(process, grace=10)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)


def test_export_opens_in_datasette_with_gpu_rows_search_and_facets(three: Path, tmp_path: Path) -> None:
    out = tmp_path / "gpus.db"
    said = export(out, db=three)
    assert "wrote 3 images" in said and "datasette" in said
    metadata = tmp_path / "gpus.metadata.json"
    assert metadata.is_file() and f"datasette {out} -m {metadata}" in said
    with datasette(out, metadata) as url:
        gpu = get_json(f"{url}/gpus/platforms.json?gpu_required=1&_shape=array")
        assert len(gpu) == 2 and all(row["gpu_required"] == 1 for row in gpu)
        images = {row["digest"]: row for row in get_json(f"{url}/gpus/images.json?_shape=array")}
        assert {images[row["digest"]]["repository"] for row in gpu} == {
            "exports/cuda-ubuntu",
            "exports/alpine-gpu",
        }
        cuda = next(row for row in gpu if images[row["digest"]]["repository"] == "exports/cuda-ubuntu")
        assert cuda["cuda_version"] == "12.2" and cuda["requirement"] and cuda["libc"] == "glibc"

        found = get_json(f"{url}/gpus/images.json?_search=alpine&_shape=array")
        assert [row["repository"] for row in found] == ["exports/alpine-gpu"]

        faceted = get_json(f"{url}/gpus/platforms.json?_facet=libc")
        counts = {item["value"]: item["count"] for item in faceted["facet_results"]["libc"]["results"]}
        assert counts == {"glibc": 2, "musl": 1}

        # the file answers a new question in one query: the canned one, and the env table joined
        shared = get_json(f"{url}/gpus/layers_shared_by_gpu_images.json?_shape=array")
        assert shared and max(row["gpu_images"] for row in shared) >= 1
        env = get_json(f"{url}/gpus/env.json?name=NVIDIA_VISIBLE_DEVICES&_shape=array")
        assert {row["digest"] for row in env} == {row["digest"] for row in gpu}
    with contextlib.closing(sqlite3.connect(out)) as conn:
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
        keys = {row[2] for row in conn.execute("PRAGMA foreign_key_list(platform_layers)")}
        assert keys == {"platforms", "layers"}


def test_sqlite_and_postgres_stores_export_the_same_rows(
    three: Path, tmp_path: Path, postgres_url: str
) -> None:
    from store.postgres import PostgresStore

    source = SqliteStore(three, upgrade=False)
    target = PostgresStore(postgres_url, pool_size=2)
    try:
        after = ""
        while page := source.run(queries.report_page, after=after, since=None, limit=2):
            for report in page:
                target.run(queries.save_report, report)
            after = page[-1].digest or ""
        target.run(
            queries.upsert_server,
            "gpu-1",
            json.dumps({"name": "gpu-1", "gpus": [{"index": 0, "uuid": "GPU-1", "name": "H100"}]}),
        )
        source_servers = target.run(queries.servers)
    finally:
        source.close()
        target.close()
    from_sqlite, from_postgres = tmp_path / "from-sqlite.db", tmp_path / "from-postgres.db"
    export(from_sqlite, db=three)
    said = export(from_postgres, env={"GPUBADGE_DATABASE_URL": postgres_url})
    assert "wrote 3 images" in said and "1 server GPU rows" in said and postgres_url not in said
    assert len(source_servers) == 1
    for table in TABLES[:-1]:
        assert rows(from_sqlite, table) == rows(from_postgres, table), table
        assert rows(from_sqlite, table), table
    assert [row[:2] for row in rows(from_postgres, "servers")] == [("GPU-1", "gpu-1")]
    later = export(
        tmp_path / "none-yet.db",
        "--since",
        "2999-01-01T00:00:00Z",
        env={"GPUBADGE_DATABASE_URL": postgres_url},
    )
    assert "wrote 0 images" in later
    earlier = export(
        tmp_path / "all.db", "--since", "2000-01-01T00:00:00Z", env={"GPUBADGE_DATABASE_URL": postgres_url}
    )
    assert "wrote 3 images" in earlier


def test_export_again_upserts_by_digest_and_since_takes_only_the_new(
    refs: dict[str, str], tmp_path: Path
) -> None:
    db, out = tmp_path / "store.db", tmp_path / "nightly.db"
    scan(db, *(refs[name] for name in (*GPU_IMAGES, CPU_IMAGE)))
    export(out, db=db)
    between = datetime.now(UTC)
    scan(db, refs[LATER_IMAGE])

    said = export(out, db=db)
    assert "wrote 4 images" in said and "it holds 4 images, 4 platforms" in said
    images = rows(out, "images")
    assert len(images) == len({row[0] for row in images}) == 4
    with contextlib.closing(sqlite3.connect(out)) as conn:
        assert conn.execute("SELECT count(*) FROM images_fts").fetchone()[0] == 4
        assert conn.execute("SELECT count(*) FROM platforms").fetchone()[0] == 4
        linked = conn.execute("SELECT count(*), count(DISTINCT platform_id || position) FROM platform_layers")
        total, distinct = linked.fetchone()
        assert total == distinct

    # a changed report replaces the old rows, in every table and in the search index
    store = SqliteStore(db, upgrade=False)
    try:
        (report,) = [
            r
            for r in store.run(queries.report_page, after="", since=None, limit=10)
            if r.repository == "exports/alpine-gpu"
        ]
        platform = report.platforms[0]
        gpu = platform.gpu.model_copy(update={"cuda_version": "12.9", "env": {"NVIDIA_VISIBLE_DEVICES": "0"}})
        changed = report.model_copy(
            update={
                "repository": "exports/alpine-gpu-renamed",
                "platforms": [platform.model_copy(update={"gpu": gpu})],
            }
        )
        store.run(queries.save_report, changed)
    finally:
        store.close()
    export(out, db=db)
    with contextlib.closing(sqlite3.connect(out)) as conn:
        assert conn.execute("SELECT count(*) FROM images").fetchone()[0] == 4
        assert conn.execute(
            "SELECT cuda_version FROM platforms WHERE digest = ?", [report.digest]
        ).fetchall() == [("12.9",)]
        assert conn.execute("SELECT value FROM env WHERE digest = ?", [report.digest]).fetchall() == [("0",)]
        search = "SELECT count(*) FROM images_fts WHERE images_fts MATCH ?"
        assert conn.execute(search, ['"alpine-gpu-renamed"']).fetchone()[0] == 1
        assert conn.execute(search, ["renamed"]).fetchone()[0] == 1

    # an image the store no longer holds (here: deleted by hand) leaves with the next full export,
    # not with a --since one
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("DELETE FROM reports WHERE repository = 'exports/plain-glibc'")
    assert "removed" not in export(out, "--since", "1m", db=db)
    assert len(rows(out, "images")) == 4
    said = export(out, db=db)
    assert "removed 1 images no longer stored" in said and "it holds 3 images, 3 platforms" in said
    with contextlib.closing(sqlite3.connect(out)) as conn:
        assert conn.execute("SELECT count(*) FROM images_fts").fetchone()[0] == 3
        assert (
            conn.execute(
                "SELECT count(*) FROM platform_layers WHERE platform_id NOT IN (SELECT id FROM platforms)"
            ).fetchone()[0]
            == 0
        )
        assert (
            conn.execute(
                "SELECT count(*) FROM env WHERE digest NOT IN (SELECT digest FROM images)"
            ).fetchone()[0]
            == 0
        )

    only_new = tmp_path / "since.db"
    said = export(only_new, "--since", between.isoformat(), db=db)
    assert "wrote 1 images" in said
    assert [row[3] for row in rows(only_new, "images")] == ["exports/static"]
    assert [row[9] for row in rows(only_new, "platforms")] == ["none"]


def _many_reports(db: Path, count: int) -> None:
    """`count` more reports: copies of a scanned one under new digests (setup, not under test)."""
    store = SqliteStore(db)
    try:
        (template, *_) = store.run(queries.report_page, after="", since=None, limit=1)
        for number in range(count):
            digest = f"sha256:{number:064x}"
            platforms = [p.model_copy(update={"digest": digest}) for p in template.platforms]
            store.run(
                queries.save_report, template.model_copy(update={"digest": digest, "platforms": platforms})
            )
    finally:
        store.close()


def _progress(terminal: bytes) -> int:
    """The count on the progress bar's latest frame (0 before the first)."""
    frames = re.findall(rb"\] ([\d,]+)/4,003 images", terminal)
    return int(frames[-1].replace(b",", b"")) if frames else 0


def test_an_export_killed_mid_way_leaves_the_previous_file_intact(three: Path, tmp_path: Path) -> None:
    db, out = tmp_path / "big.db", tmp_path / "kept.db"
    export(out, db=three)
    before = digest_of(out)
    with (
        contextlib.closing(sqlite3.connect(three)) as source,
        contextlib.closing(sqlite3.connect(db)) as copy,
    ):
        source.backup(copy)
    _many_reports(db, 4000)

    # stderr on a terminal: the progress bar is the event the kill waits for
    controller, terminal = pty.openpty()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpubadge.cli",
            "export",
            "sqlite",
            str(out),
            "--db",
            str(db),
            "--batch-size",
            "20",
        ],
        stdout=subprocess.DEVNULL,
        stderr=terminal,
    )
    os.close(terminal)
    seen = b""
    try:
        deadline = time.monotonic() + 120
        while not 0 < _progress(seen) < 4003:
            assert process.poll() is None and time.monotonic() < deadline, seen[-200:]
            ready, _, _ = select.select([controller], [], [], 1.0)
            if ready:
                seen += os.read(controller, 4096)
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=30) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        os.close(controller)
    assert digest_of(out) == before
    assert len(rows(out, "images")) == 3

    said = export(out, db=db)  # the next export still accepts the file and completes it
    assert "it holds 4,003 images" in said


def test_bad_targets_are_refused_and_left_as_they_were(three: Path, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    store_copy = tmp_path / "store-copy.db"
    with (
        contextlib.closing(sqlite3.connect(three)) as source,
        contextlib.closing(sqlite3.connect(store_copy)) as copy,
    ):
        source.backup(copy)
    for target in (notes, store_copy):
        before = digest_of(target)
        done = gpubadge("export", "sqlite", str(target), "--db", str(three))
        assert done.returncode == 1
        assert "is not a gpubadge export; not overwriting it" in done.stderr
        assert digest_of(target) == before

    locked = tmp_path / "locked.db"
    export(locked, db=three)
    before = digest_of(locked)
    locked.chmod(0o444)
    done = gpubadge("export", "sqlite", str(locked), "--db", str(three))
    assert done.returncode == 1 and "is read-only" in done.stderr
    assert digest_of(locked) == before

    missing = gpubadge("export", "sqlite", str(tmp_path / "nowhere" / "x.db"), "--db", str(three))
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    no_store = gpubadge("export", "sqlite", str(tmp_path / "x.db"), "--db", str(tmp_path / "absent.db"))
    assert no_store.returncode == 1 and "no store at" in no_store.stderr
    usage = gpubadge("export", "sqlite", str(tmp_path / "x.db"), "--since", "yesterday-ish")
    assert usage.returncode == 2 and "not a time" in usage.stderr


def test_files_are_written_only_where_asked(three: Path, tmp_path: Path) -> None:
    """Issue 30 (9): a link planted at the metadata file's old temporary name is never followed, and a
    metadata file gpubadge did not write is never replaced (nor is `OUT` written beside it)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "planted.db"
    (tmp_path / ".planted.metadata.json.tmp").symlink_to(victim)  # the name the export used to use
    export(out, db=three)
    assert victim.read_text() == "precious\n"
    ours = json.loads((tmp_path / "planted.metadata.json").read_text())
    assert ours["gpubadge_export"]["format"] == "gpubadge-export"
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp") and not p.is_symlink()]
    export(out, db=three)  # its own sidecar, marked: replaced

    foreign = tmp_path / "theirs.db"
    sidecar = tmp_path / "theirs.metadata.json"
    sidecar.write_text('{"title": "someone else\'s Datasette metadata"}\n')
    done = gpubadge("export", "sqlite", str(foreign), "--db", str(three))
    assert done.returncode == 1, done.stderr
    assert f"{sidecar} exists and was not written by gpubadge; not replacing it" in done.stderr
    assert "Traceback" not in done.stderr
    assert sidecar.read_text() == '{"title": "someone else\'s Datasette metadata"}\n'
    assert not foreign.exists()

    linked = tmp_path / "linked.db"
    (tmp_path / "linked.metadata.json").symlink_to(victim)
    done = gpubadge("export", "sqlite", str(linked), "--db", str(three))
    assert done.returncode == 1 and "is not a regular file" in done.stderr, done.stderr
    assert victim.read_text() == "precious\n" and not linked.exists()


def test_a_full_disk_is_a_clear_error_and_the_previous_file_stays(three: Path, tmp_path: Path) -> None:
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=640k", "tmpfs", str(small)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill: {mounted.stderr.strip()}")
    try:
        db = tmp_path / "big.db"
        with (
            contextlib.closing(sqlite3.connect(three)) as source,
            contextlib.closing(sqlite3.connect(db)) as copy,
        ):
            source.backup(copy)
        out = small / "gpubadge.db"
        export(out, db=three)
        before = digest_of(out)
        _many_reports(db, 3000)
        done = gpubadge("export", "sqlite", str(out), "--db", str(db))
        assert done.returncode == 1
        assert "no space left on the disk" in done.stderr, done.stderr
        assert digest_of(out) == before
        assert sorted(path.name for path in small.iterdir()) == ["gpubadge.db", "gpubadge.metadata.json"]
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_the_service_streams_the_export_to_a_token_holder_only(three: Path, tmp_path: Path) -> None:
    db = tmp_path / "service.db"
    with (
        contextlib.closing(sqlite3.connect(three)) as source,
        contextlib.closing(sqlite3.connect(db)) as copy,
    ):
        source.backup(copy)
    token = "export-token-1"
    with run_service_process(db, env={"GPUBADGE_API_TOKEN": token, "GPUBADGE_WORKERS": "0"}) as service:
        url = f"{service.url}/api/export.sqlite"
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30)
            assert refused.value.code == 401
            assert "API token" in json.load(refused.value)["error"]
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.headers["Content-Type"] == "application/vnd.sqlite3"
            body = response.read()
            assert len(body) == int(response.headers["Content-Length"])
    downloaded = tmp_path / "downloaded.db"
    downloaded.write_bytes(body)
    assert len(rows(downloaded, "images")) == 3
    assert len([row for row in rows(downloaded, "platforms") if row[5] == 1]) == 2
    assert token not in service.log()
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob("gpubadge-export-*/gpubadge.db"))


async def test_without_a_configured_token_nobody_may_export(tmp_path: Path) -> None:
    from fixtures.service import run_service_inprocess
    from web.settings import ServiceSettings

    async with run_service_inprocess(ServiceSettings(db=tmp_path / "open.db", workers=0)) as service:
        request = urllib.request.Request(
            f"{service.url}/api/export.sqlite", headers={"Authorization": "Bearer x"}
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            await asyncio.to_thread(urllib.request.urlopen, request, timeout=30)
    assert refused.value.code == 403
    assert "GPUBADGE_API_TOKEN" in json.load(refused.value)["error"]


def test_since_reads_ages_and_times() -> None:
    from gpubadge.export import parse_since

    assert abs(parse_since("24h") - (datetime.now(UTC) - timedelta(hours=24))) < timedelta(seconds=5)
    assert parse_since("2026-11-24T18:00:00") == datetime(2026, 11, 24, 18, tzinfo=UTC)
    assert parse_since("2026-11-24T18:00:00+02:00") == datetime(2026, 11, 24, 16, tzinfo=UTC)


def test_report_pages_cover_every_report_once_on_both_engines(open_backend: Any) -> None:
    """The store's paged read, as the export runs it: keyset pages in digest order, `since` by scan time."""
    from scanner.models import ImageReport, PlatformReport

    backend = open_backend()
    start = datetime(2026, 11, 1, tzinfo=UTC)
    for number in range(7):
        digest = f"sha256:{number * 2:064x}"
        backend.run(
            queries.save_report,
            ImageReport(
                reference=f"r.example/app{number}:1",
                digest=digest,
                registry="r.example",
                repository=f"app{number}",
                scanned_at=start + timedelta(hours=number),
                platforms=[PlatformReport(platform="linux/amd64", digest=digest)],
            ),
        )
    seen: list[str] = []
    after = ""
    while page := backend.run(queries.report_page, after=after, since=None, limit=3):
        assert len(page) <= 3
        seen += [report.digest for report in page]
        after = seen[-1]
        if (
            len(seen) == 3
        ):  # saved behind the cursor while the export runs: not read twice, not shifting a page
            backend.run(
                queries.save_report,
                ImageReport(reference="r.example/late:1", digest=f"sha256:{1:064x}", scanned_at=start),
            )
    assert seen == [f"sha256:{number * 2:064x}" for number in range(7)]
    recent = backend.run(
        queries.report_page, after="", since=start + timedelta(hours=4, minutes=30), limit=10
    )
    assert [report.repository for report in recent] == ["app5", "app6"]
    assert recent[0].scanned_at == start + timedelta(hours=5)


def test_export_says_which_store_it_read_and_writes_the_inventory_files_servers(
    three: Path, tmp_path: Path
) -> None:
    """The service's fleet is its inventory file's servers and its agents'; the demo's is the file alone."""
    fleet = Path(__file__).parent.parent / "fixtures" / "fleet.yaml"
    servers = yaml.safe_load(fleet.read_text())["servers"]
    gpus = sum(len(server.get("gpus") or []) for server in servers)
    alone = export(tmp_path / "alone.db", db=three)
    assert "and 0 server GPU rows" in alone and "pass --inventory FILE" in alone.splitlines()[-2]
    out = tmp_path / "fleet.db"
    said = export(out, db=three, env={"GPUBADGE_INVENTORY_FILE": str(fleet)})
    assert said.splitlines()[0] == f"read SQLite {three.absolute()} and the inventory {fleet}"
    assert f"and {gpus} server GPU rows" in said
    with contextlib.closing(sqlite3.connect(out)) as conn:
        names = {row[0] for row in conn.execute("SELECT server FROM servers")}
        counted = conn.execute("SELECT count(*) FROM servers WHERE gpu_uuid IS NOT NULL").fetchone()[0]
    assert names == {server["name"] for server in servers} and counted == gpus

    bad = tmp_path / "bad.yaml"
    bad.write_text("servers:\n  - name: x\n    cpus: many\n")
    done = gpubadge("export", "sqlite", str(tmp_path / "no.db"), "--db", str(three), "--inventory", str(bad))
    assert done.returncode == 1
    assert (
        done.stderr.strip()
        == f"gpubadge export: inventory {bad}: line 3, servers[0].cpus: expected an integer, got 'many'"
    )
