"""Every CLI message a user meets when something is wrong, by subprocess: its exit status, its words,
and never a traceback or a pydantic dump. Also a reader that goes away (`| head`): the command ends
quietly with 141, as git does, and what a scan scanned is stored."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from fixtures import catalog
from fixtures.registry import LocalRegistry
from tests.conftest import Pusher
from tests.test_fleet_api import FLEET

FLEET_FILE = Path(__file__).parent.parent / "fixtures" / "fleet.yaml"
LEAKS = ("Traceback", "validation error for", "errors.pydantic.dev", "Task exception")


def gpubadge(*args: str, env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `gpubadge ARGS` (env: variables to set, or with None to unset); no leak on stderr."""
    merged = {**os.environ, **(env or {})}
    done = subprocess.run(
        [sys.executable, "-m", "gpubadge.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={key: value for key, value in merged.items() if value is not None},
    )
    for leak in LEAKS:
        assert leak not in done.stderr, done.stderr
    return done


def reader_gone(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run a command whose reader has already gone: its stdout is a pipe closed before it writes."""
    process = subprocess.Popen(
        [sys.executable, "-m", "gpubadge.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()  # before the interpreter has even started: its first write fails
    try:
        err = process.stderr.read().decode()
        return process.wait(timeout=60), err
    finally:
        process.kill()


# ------------------------------------------------------------------ option values: exit 2, the option


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("--min-gpu-memory", "lots", "invalid quantity 'lots'"),
        ("--memory", "lots", "invalid quantity 'lots'"),
        ("--gpus", "-1", "must be at least 0, got -1"),
        ("--gpus", "abc", "invalid int value"),
        ("--min-compute-capability", "nine", "'nine' is not a version"),
        ("--min-driver", "x.y", "'x.y' is not a version"),
        ("--cpus", "-2", "must be at least 0"),
        ("--label", "zone", "expected key=value, got 'zone'"),
        ("--limit", "0", "must be at least 1, got 0"),
        ("--mig-devices", "-1", "must be at least 0, got -1"),
        ("--mig-profile", "huge", "'huge' is not a MIG profile such as 1g.10gb"),
    ],
)
def test_a_bad_option_value_is_a_usage_error_naming_the_option(option: str, value: str, words: str) -> None:
    done = gpubadge("eligible", "example.invalid/app:1", "--servers", str(FLEET_FILE), option, value)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("usage: gpubadge eligible")
    assert f"error: argument {option}: " in done.stderr and words in done.stderr


@pytest.mark.parametrize(
    ("args", "option", "words"),
    [
        (("serve", "--port", "99999"), "--port", "must be 0 to 65535"),  # not a port the kernel wraps round
        (("serve", "--port", "http"), "--port", "not a port number: 'http'"),
        (("serve", "--intake-port", "-1"), "--intake-port", "must be 0 to 65535"),
        (("worker", "--metrics-port", "65536"), "--metrics-port", "must be 1 to 65535"),
    ],
)
def test_a_port_past_65535_is_a_usage_error_naming_the_option(
    args: tuple[str, ...], option: str, words: str
) -> None:
    done = gpubadge(*args)
    assert done.returncode == 2, done.stderr
    assert f"error: argument {option}: {words}" in done.stderr


A_DATABASE_URL = "postgresql://gpubadge:hunter2@db.example/gpubadge"


@pytest.mark.parametrize(
    "args",
    [
        ("scan", "alpine", "--db", A_DATABASE_URL),
        ("export", "sqlite", "out.db", "--db", A_DATABASE_URL),
        ("serve", "--db", A_DATABASE_URL),
        ("worker", "--db", A_DATABASE_URL),
        ("db", "upgrade", "--db", A_DATABASE_URL),
    ],
)
def test_a_database_url_given_as_db_is_a_usage_error_and_no_file(
    args: tuple[str, ...], tmp_path: Path
) -> None:
    """`--db postgresql://…` would store every report in a file named after the URL, unseen."""
    done = subprocess.run(
        [sys.executable, "-m", "gpubadge.cli", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert (
        "error: argument --db: a URL is not a SQLite file; PostgreSQL is named by GPUBADGE_DATABASE_URL"
        in (done.stderr)
    )
    assert "hunter2" not in done.stderr and "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args", [("scan", "alpine"), ("export", "sqlite", "out.db"), ("serve",), ("worker",)]
)
def test_a_database_url_in_gpubadge_db_is_refused_naming_it(args: tuple[str, ...], tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key != "GPUBADGE_DATABASE_URL"}
    done = subprocess.run(
        [sys.executable, "-m", "gpubadge.cli", *args],
        cwd=tmp_path,
        env={**env, "GPUBADGE_DB": A_DATABASE_URL, "XDG_DATA_HOME": str(tmp_path / "data")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "invalid settings: GPUBADGE_DB: a URL is not a SQLite file" in done.stderr, done.stderr
    assert "hunter2" not in done.stderr and "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_port_setting_past_65535_is_refused_naming_it() -> None:
    done = gpubadge("serve", env={"GPUBADGE_PORT": "70000"})
    assert done.returncode == 2, done.stderr
    assert "GPUBADGE_PORT: must be at most 65535" in done.stderr


def test_whole_gpus_and_mig_devices_together_is_a_usage_error() -> None:
    done = gpubadge(
        "eligible", "example.invalid/app:1", "--servers", str(FLEET_FILE), "--gpus", "1", "--mig-devices", "2"
    )
    assert done.returncode == 2, done.stderr
    assert "error: argument --mig-devices: " in done.stderr and "not both" in done.stderr


def test_constraints_checks_its_options_as_eligible_does() -> None:
    done = gpubadge(
        "constraints",
        "example.invalid/app:1",
        "--format",
        "nomad",
        "--servers",
        str(FLEET_FILE),
        "--gpus",
        "-1",
    )
    assert done.returncode == 2 and "argument --gpus: must be at least 0, got -1" in done.stderr


def test_an_unknown_option_before_any_command_is_named() -> None:
    """As git names `--bogus` ("unknown option"), not the command that did not follow it."""
    done = gpubadge("--bogus")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("usage: gpubadge ") and done.stderr.rstrip().endswith(
        "gpubadge: error: unrecognized arguments: --bogus"
    )
    assert "required" not in done.stderr
    alone = gpubadge()
    assert alone.returncode == 2 and "the following arguments are required: COMMAND" in alone.stderr


def test_scan_prints_its_own_usage_for_an_unknown_option() -> None:
    done = gpubadge("scan", "--frobnicate", "alpine")
    assert done.returncode == 2
    assert (
        done.stderr.startswith("usage: gpubadge scan")
        and "unrecognized arguments: --frobnicate" in done.stderr
    )


# ------------------------------------------------------------------ --service: what is wrong, what to do


def test_a_service_address_without_a_scheme_shows_the_fix() -> None:
    done = gpubadge("eligible", "example.invalid/app:1", "--service", "127.0.0.1:18080")
    assert done.returncode == 2
    assert "argument --service: '127.0.0.1:18080' has no scheme: write http://127.0.0.1:18080" in done.stderr


def test_nothing_listening_at_the_service_address_says_so() -> None:
    with socket.socket() as unused:  # bound, never listening: connections to it are refused
        unused.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{unused.getsockname()[1]}"
        done = gpubadge("eligible", "example.invalid/app:1", "--service", url)
    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"gpubadge eligible: nothing is listening at {url} (connection refused): check --service, or"
        " start the service there (`gpubadge serve`)"
    )


class _NotGpubadge(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.send_response(404)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(b"<html>not here</html>")

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def _web_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotGpubadge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join(timeout=10)


def test_a_service_address_that_is_not_gpubadge_says_so() -> None:
    with _web_server() as url:
        done = gpubadge("eligible", "example.invalid/app:1", "--service", url)
    assert done.returncode == 1
    assert f"{url}/api/eligibility answered 404 (text/html), not gpubadge's JSON" in done.stderr


# ------------------------------------------------------------------ files: the file, the line, the path


def test_a_bad_inventory_names_the_file_the_line_the_path_and_what_was_expected(tmp_path: Path) -> None:
    inventory = tmp_path / "fleet.yaml"
    inventory.write_text(
        "servers:\n"
        "  - name: a\n"
        "    gpus:\n"
        "      - index: 0\n"
        "        uuid: GPU-1\n"
        "        name: NVIDIA A100\n"
        "        memory_mib: lots\n"
    )
    done = gpubadge("eligible", "example.invalid/app:1", "--servers", str(inventory))
    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"gpubadge eligible: inventory {inventory}: line 7, servers[0].gpus[0].memory_mib:"
        " expected an integer, got 'lots'"
    )

    inventory.write_text("servers: [\n")
    done = gpubadge("eligible", "example.invalid/app:1", "--servers", str(inventory))
    assert (
        done.returncode == 1 and f"inventory {inventory}: not YAML or JSON: line 2, column 1:" in done.stderr
    )

    missing = tmp_path / "nowhere.yaml"
    done = gpubadge("constraints", "example.invalid/app:1", "--format", "dra", "--servers", str(missing))
    assert (
        done.returncode == 1
        and done.stderr.strip() == f"gpubadge constraints: inventory {missing}: no such file"
    )


def test_a_bad_settings_file_names_the_file_the_line_and_the_setting(tmp_path: Path) -> None:
    settings = tmp_path / "gpubadge.yaml"
    settings.write_text("scanner:\n  retries: 3\n  max_layers: lots\n")
    done = gpubadge("scan", "--no-store", "--config", str(settings), "example.invalid/app:1")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"gpubadge scan: invalid settings: config file {settings}, line 3, scanner.max_layers: expected an integer"
    )
    settings.write_text("retries: [\n")
    done = gpubadge("config", "--config", str(settings))
    assert done.returncode == 2 and f"config file {settings}: not YAML: line 2, column 1:" in done.stderr

    toml = tmp_path / "gpubadge.toml"
    toml.write_text('workers = "many"\n')
    done = gpubadge("config", "--config", str(toml))
    assert done.returncode == 2 and f"config file {toml}, workers: expected an integer" in done.stderr

    done = gpubadge("config", env={"GPUBADGE_WORKERS": "many"})
    assert done.returncode == 2 and "invalid settings: GPUBADGE_WORKERS: expected an integer" in done.stderr


def test_a_bad_spec_or_node_file_names_the_file(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("version: v1alpha1\ncompatibilities: [\n")
    done = gpubadge("compat", "--spec", str(spec), "--servers", str(FLEET_FILE))
    assert (
        done.returncode == 1 and f"gpubadge compat: spec {spec}: not YAML: line 3, column 1:" in done.stderr
    )
    spec.write_text("version: v1alpha1\ncompatibilities: 5\n")  # NFD accepts a missing list, not a number
    done = gpubadge("compat", "--spec", str(spec), "--servers", str(FLEET_FILE))
    assert done.returncode == 1 and f"spec {spec}: compatibilities: cannot decode number" in done.stderr
    done = gpubadge("compat", "--spec", str(tmp_path / "gone.yaml"), "--servers", str(FLEET_FILE))
    assert done.returncode == 1 and "gone.yaml: no such file" in done.stderr


# ------------------------------------------------------------------ references, settings, stores


def test_a_malformed_reference_is_not_retryable() -> None:
    done = gpubadge("scan", "UPPER//x", "--json", "--no-store")
    assert done.returncode == 1
    report = json.loads(done.stdout)
    assert report["error"].startswith("invalid reference") and report["retryable"] is False


def test_config_shows_the_store_scan_uses(tmp_path: Path) -> None:
    expected = tmp_path / "data" / "gpubadge" / "gpubadge.db"
    for unset in (None, ""):  # GPUBADGE_DB unset, or set but empty: the default, for both commands
        env: dict[str, str | None] = {"XDG_DATA_HOME": str(tmp_path / "data"), "GPUBADGE_DB": unset}
        shown = json.loads(gpubadge("config", "--json", env=env).stdout)
        db = next(row for row in shown["settings"] if row["variable"] == "GPUBADGE_DB")
        assert db["value"] == str(expected)
        usage = gpubadge("scan", "--help", env=env).stdout
        assert str(expected) in usage.replace("\n", "").replace(" ", "")


# ------------------------------------------------------------------ a reader that goes away


def test_a_reader_that_goes_away_ends_config_and_help_quietly() -> None:
    for args in (("config",), ("config", "--json")):
        status, err = reader_gone(*args)
        assert (status, err) == (141, ""), err


def test_a_reader_that_goes_away_ends_a_scan_quietly_and_keeps_its_reports(
    registry: LocalRegistry, push: Pusher, tmp_path: Path
) -> None:
    refs = []
    for number in range(6):
        push(catalog.plain_glibc(), f"pipe/app:{number}")
        refs.append(f"{registry.host}/pipe/app:{number}")
    db = tmp_path / "store.db"

    status, err = reader_gone("scan", "--db", str(db), *refs)  # the table: printed once all are stored
    assert (status, err) == (141, ""), err
    with contextlib.closing(sqlite3.connect(db)) as conn:
        assert {row[0] for row in conn.execute("SELECT tag FROM tags")} == {str(n) for n in range(6)}

    fresh = tmp_path / "fresh.db"
    status, err = reader_gone("scan", "--json", "--db", str(fresh), *refs)  # --json: lines as reports commit
    assert (status, err) == (141, ""), err
    with contextlib.closing(sqlite3.connect(fresh)) as conn:
        tags = conn.execute("SELECT count(*) FROM tags").fetchone()[0]
        orphans = conn.execute(
            "SELECT count(*) FROM tags WHERE digest NOT IN (SELECT digest FROM reports)"
        ).fetchone()[0]
    assert tags >= 1 and orphans == 0  # what was scanned before it stopped is stored, whole

    # the --json lines come in input order, as the table's rows do
    done = gpubadge("scan", "--json", "--concurrency", "6", "--db", str(fresh), *reversed(refs))
    assert [json.loads(line)["reference"] for line in done.stdout.splitlines()] == list(reversed(refs))


def test_a_reader_that_goes_away_ends_eligible_quietly(
    registry: LocalRegistry, push: Pusher, tmp_path: Path
) -> None:
    push(catalog.cuda_ubuntu(), "pipe/cuda:12.2")
    servers = tmp_path / "servers.yaml"
    servers.write_text(yaml.safe_dump(FLEET))
    status, err = reader_gone("eligible", f"{registry.host}/pipe/cuda:12.2", "--servers", str(servers))
    assert (status, err) == (141, ""), err
