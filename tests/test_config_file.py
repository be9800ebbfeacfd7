"""The settings file, TOML or YAML, read by the real loader and by `gpubadge serve` itself."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import annotated_types
import pytest
import yaml
from pydantic import ValidationError

from fixtures.service import run_service_process
from scanner.settings import RETIRED_SETTINGS, ScannerSettings
from tests.test_service_e2e import call
from web.commands import load_settings
from web.settings import ServiceSettings, unknown_settings

TOKEN = "file-api-token-61b0"
GHCR_SECRET = "file-ghcr-secret-0c3d"

TOML = f"""
api_token = "{TOKEN}"
public_reads = false
json_max_depth = 12
stale_after_seconds = 90.5

[webhook_secrets]
ghcr = "{GHCR_SECRET}"

[agent_tokens]
node-a = "agent-a-from-file"

[[registries]]
host = "registry.example.com"
username = "scanner"
password = "registry-password"

[[registries]]
host = "docker.io"
mirror = "mirror.example.com"
"""

SETTINGS = {
    "api_token": TOKEN,
    "public_reads": False,
    "json_max_depth": 12,
    "stale_after_seconds": 90.5,
    "webhook_secrets": {"ghcr": GHCR_SECRET},
    "agent_tokens": {"node-a": "agent-a-from-file"},
    "registries": [
        {"host": "registry.example.com", "username": "scanner", "password": "registry-password"},
        {"host": "docker.io", "mirror": "mirror.example.com"},
    ],
}


def write_config(directory: Path, kind: str) -> Path:
    path = directory / f"gpubadge.{kind}"
    path.write_text(TOML if kind == "toml" else yaml.safe_dump(SETTINGS))
    return path


@pytest.mark.parametrize("kind", ["toml", "yaml"])
def test_the_loader_reads_every_kind_of_value(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GPUBADGE_CONFIG", raising=False)
    monkeypatch.setenv("GPUBADGE_STALE_AFTER_SECONDS", "30")  # the environment wins over the file
    settings = load_settings(write_config(tmp_path, kind), port=9999)
    assert settings.api_token is not None and settings.api_token.get_secret_value() == TOKEN
    assert settings.public_reads is False and settings.json_max_depth == 12
    assert settings.json_limits().max_depth == 12
    assert settings.stale_after_seconds == 30.0
    assert settings.port == 9999  # and command-line options win over both
    assert {source: secret.get_secret_value() for source, secret in settings.webhook_secrets.items()} == {
        "ghcr": GHCR_SECRET
    }
    assert settings.webhook_refused("quay") and not settings.webhook_refused("ghcr")
    assert settings.agent_tokens["node-a"].get_secret_value() == "agent-a-from-file"
    assert [entry.host for entry in settings.registries] == ["registry.example.com", "docker.io"]
    assert settings.allows("mirror.example.com") and not settings.allows("elsewhere.example.com")
    assert "registry-password" not in repr(settings) and TOKEN not in repr(settings)


@pytest.mark.parametrize("kind", ["toml", "yaml"])
def test_serve_runs_with_the_file(tmp_path: Path, kind: str) -> None:
    """`gpubadge serve` with GPUBADGE_CONFIG: the file's private reads and per-source secret hold."""
    env = {"GPUBADGE_CONFIG": str(write_config(tmp_path, kind))}
    with run_service_process(tmp_path / "serve.db", env=env) as service:
        assert call("GET", f"{service.url}/api/images").status == 401
        assert (
            call("GET", f"{service.url}/api/images", headers={"Authorization": f"Bearer {TOKEN}"}).status
            == 200
        )
        refused = call("POST", f"{service.url}/hooks/quay", {"repository": "x"})
        assert refused.status == 401 and "no secret is configured for quay" in refused.body["error"]
        assert call("GET", f"{service.url}/healthz").status == 200


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("public_reads: false\n", "public_reads=false needs an api_token"),
        ("webhook_secrets: {gitlab: x}\n", "unknown sources gitlab"),
        ("json_max_depth: 1\n", "json_max_depth"),
        ("- just\n- a list\n", "expected a mapping"),
    ],
    ids=["private-without-token", "unknown-source", "depth-too-small", "not-a-mapping"],
)
def test_serve_refuses_a_bad_file_with_a_reason(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpubadge.cli",
            "serve",
            "--config",
            str(path),
            "--db",
            str(tmp_path / "x.db"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert "invalid settings" in result.stderr and message in result.stderr


@pytest.mark.parametrize(
    ("name", "content", "where"),
    [
        ("unterminated.yaml", 'port: 1\napi_token: "s3cret-in-a-broken-line\n', "line 3, column 1"),
        ("indent.yaml", "registries:\n  - host: a\n   api_token: s3cret-in-a-broken-line: x\n", "line 3"),
        ("tag.yaml", "api_token: !s3cret-in-a-broken-line x\n", "line 1, column 12"),
        ("broken.toml", 'api_token = "s3cret-in-a-broken-line\n', "line 1"),
    ],
    ids=["yaml-unterminated", "yaml-indent", "yaml-tag", "toml"],
)
@pytest.mark.parametrize("command", ["config", "serve"])
def test_a_file_that_does_not_parse_names_file_and_line_never_its_content(
    tmp_path: Path, name: str, content: str, where: str, command: str
) -> None:
    """Issue 30 (10): one line naming the file and the line; no traceback, no secret."""
    path = tmp_path / name
    path.write_text(content)
    result = subprocess.run(
        [sys.executable, "-m", "gpubadge.cli", command, "--config", str(path), "--db", str(tmp_path / "x.db")]
        if command == "serve"
        else [sys.executable, "-m", "gpubadge.cli", command, "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert str(path) in lines[0] and where in lines[0], lines[0]
    assert "s3cret" not in result.stderr + result.stdout and "Traceback" not in result.stderr


def test_mirror_user_info_is_redacted_by_config(tmp_path: Path) -> None:
    """Issue 30 (10): a mirror written as a URL with user:password@ shows the user, never the password."""
    path = tmp_path / "mirrors.yaml"
    path.write_text(
        "registries:\n  - host: ghcr.io\n    mirror: https://bob:hunter2-mirror@mirror.local:5000\n"
        "docker_mirror: alice:hunter3-mirror@hub-mirror:5000\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "gpubadge.cli", "config", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "hunter" not in result.stdout + result.stderr
    assert "https://bob:[redacted]@mirror.local:5000" in result.stdout
    assert "alice:[redacted]@hub-mirror:5000" in result.stdout


@pytest.mark.parametrize("old", sorted(RETIRED_SETTINGS))
def test_a_retired_setting_is_refused_naming_its_replacement(
    old: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deep scan's own bounds are gone: set by keyword, file or environment, each fails loudly."""
    monkeypatch.delenv("GPUBADGE_CONFIG", raising=False)
    message = rf"setting {old} \(GPUBADGE_{old.upper()}\) was removed: {re.escape(RETIRED_SETTINGS[old])}"
    with pytest.raises(ValidationError, match=message):
        ScannerSettings(docker_config=None, **{old: 1})
    monkeypatch.setenv(f"GPUBADGE_{old.upper()}", "1")
    with pytest.raises(ValidationError, match=message):
        ScannerSettings(docker_config=None)


def test_serve_refuses_a_retired_setting_in_its_environment(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("GPUBADGE_")}
    env["GPUBADGE_DEEP_SCAN_SECONDS"] = "30"
    result = subprocess.run(
        [sys.executable, "-m", "gpubadge.cli", "serve", "--db", str(tmp_path / "x.db")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 2, result.stderr
    assert "deep_scan_seconds (GPUBADGE_DEEP_SCAN_SECONDS) was removed" in result.stderr
    assert "set max_scan_seconds" in result.stderr and "Traceback" not in result.stderr


def test_a_misspelt_variable_is_named_with_the_setting_it_is_near(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("GPUBADGE_")}
    env |= {
        "GPUBADGE_MAX_QUEUED_JOBS": "5",  # max_queued_scans
        "GPUBADGE_AGENT_TOKENS__NODE_A": "x",  # an entry of a setting that takes keys
        "GPUBADGE_BENCH_PEER_TREE": "/x",  # the project's tooling
        "GPUBADGE_DB": str(tmp_path / "x.db"),
    }
    result = subprocess.run(
        [sys.executable, "-m", "gpubadge.cli", "config"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        "gpubadge config: warning: GPUBADGE_MAX_QUEUED_JOBS is not a gpubadge setting"
        " (did you mean GPUBADGE_MAX_QUEUED_SCANS?); it is ignored"
    ]


# A name that stands for any setting in a docstring, and the README's example of a misspelt one.
PLACEHOLDERS = {"GPUBADGE_X", "GPUBADGE_X__KEY", "GPUBADGE_MAX_QUEUED_JOBS"}


def test_every_variable_the_repository_names_is_one_a_role_reads() -> None:
    """Docs, manifests and code name only settings (or the tooling's own variables): a renamed or
    misspelt one in the README would otherwise send a user to a variable nothing reads."""
    root = Path(__file__).resolve().parent.parent
    tracked = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True)
    named: dict[str, str] = {}
    for path in tracked.stdout.split():
        if path.startswith("tests/") or path.endswith(".png"):
            continue
        text = (root / path).read_text(errors="replace")
        for name in re.findall(r"GPUBADGE_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_*])", text):
            named.setdefault(name, path)
    assert len(named) > 50
    unknown = {
        name: path
        for name, path in named.items()
        if name not in PLACEHOLDERS and unknown_settings({name: ""})
    }
    assert not unknown


def test_every_number_a_setting_takes_is_bounded() -> None:
    """A negative timeout, no retries or a zero-byte cap is refused at start, naming the setting,
    never run with: each numeric setting declares the range it means."""
    validated_elsewhere = {"worker_processes"}  # `auto` or 0 or more: its own validator
    unbounded = [
        name
        for name, field in ServiceSettings.model_fields.items()
        if re.search(r"\b(int|float)\b", str(field.annotation))
        and name not in validated_elsewhere
        and not [m for m in field.metadata if isinstance(m, (annotated_types.Ge, annotated_types.Gt))]
    ]
    assert not unbounded
    shown = {line.split()[0]: line for line in ServiceSettings.describe().splitlines()}
    assert shown["GPUBADGE_RETRIES"].endswith("[default: 4; at least 1]")  # `serve --help` says the range
    assert shown["GPUBADGE_PORT"].endswith("[default: 8080; 0 to 65535]")
    assert shown["GPUBADGE_SQLITE_BUSY_TIMEOUT"].endswith("[default: 30.0; more than 0]")


@pytest.mark.parametrize(
    ("variable", "value", "words"),
    [
        ("GPUBADGE_SQLITE_BUSY_TIMEOUT", "-5", "must be more than 0"),
        ("GPUBADGE_RETRIES", "0", "must be at least 1"),
        ("GPUBADGE_WORKERS", "-1", "must be at least 0"),
    ],
)
def test_serve_refuses_a_number_out_of_its_range(
    tmp_path: Path, variable: str, value: str, words: str
) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("GPUBADGE_")}
    env |= {variable: value, "GPUBADGE_DB": str(tmp_path / "x.db")}
    result = subprocess.run(
        [sys.executable, "-m", "gpubadge.cli", "serve"], capture_output=True, text=True, timeout=60, env=env
    )
    assert result.returncode == 2, result.stderr
    assert f"{variable}: {words}" in result.stderr and "Traceback" not in result.stderr
